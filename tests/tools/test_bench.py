"""Benchmarks: re-rendering saved results works anywhere; a tiny training-step run works on the GPU, and on the
CPU under each distributed engine with 2 processes (gloo)."""

import contextlib
import dataclasses
import importlib.util
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_scatter.cli import main
from spawned_ranks import free_port, leave_rank

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


@pytest.mark.parametrize("suite,saved", [("moe", "history/moe-h200.json"), ("moe", "history/moe-mxfp4-gpt-oss-120b-h200.json"),
                                         ("train", "train-h200.json"),
                                         ("norms", "norms-h200.json"), ("norms", "norms-h100.json"),
                                         ("convert", "convert-h200.json"), ("bert", "bert-h100.json"),
                                         ("serve", "serve-h100.json")])
def test_bench_replot_renders_table_and_png_from_saved_json(suite, saved, tmp_path, capsys):
    png = tmp_path / "plot.png"
    assert main(["bench", suite, "--replot", str(RESULTS / saved), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    report = json.loads((RESULTS / saved).read_text())
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for name in report.get("results", report.get("load_s", report.get("cases"))):  # configs, impls, load paths, cases
        assert any(f"| {name} |" in row for row in rows), name
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fsdp2_builder_shards_a_bf16_model_with_float32_modules_and_steps_it_like_the_unwrapped_one():
    """DeepSeek-V2 built in bf16 keeps its router weight in float32 (transformers' _keep_in_fp32_modules), and one
    FSDP2 group must hold one dtype: the builder gives that module a group of its own that computes in float32,
    so the model takes the unwrapped model's loss and router gradients. The optimizer keeps DTensors and plain
    tensors in separate groups (a fused step takes one kind at a time: transformers 5.17's expert parallelism
    leaves both kinds in one model)."""
    import copy

    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import hf_scatter
    from hf_scatter.bench import engines
    from hf_scatter.tiny import TINY_BUILDERS

    config = TINY_BUILDERS["deepseek_v2"](hidden=32, experts=4, top_k=2, intermediate=16).config
    torch.manual_seed(0)
    model = hf_scatter.patch_model(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}
    unwrapped = copy.deepcopy(model)
    ids = torch.randint(config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.MonkeyPatch.context() as env, engines.process_group(True, "cpu"):
        env.setenv("HF_SCATTER_KERNELS", "torch")  # the engine's set-up is under test, not the kernels
        engines.fully_shard_layers(model, torch.bfloat16)
        router = model.model.layers[1].mlp.gate
        assert isinstance(router.weight, DTensor) and router.weight.dtype == torch.float32
        step, _ = engines.adamw_step(model, ids)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mixed = torch.nn.Module()  # DTensor experts beside plain parameters, as 5.17's expert parallelism leaves
        mixed.experts = torch.nn.Parameter(distribute_tensor(torch.randn(4, 3), init_device_mesh("cpu", (1,)),
                                                             [Shard(0)]))
        mixed.norm = torch.nn.Parameter(torch.randn(3))
        _, mixed_opt = engines.adamw_step(mixed, ids)
        kinds = [{isinstance(p, DTensor) for p in group["params"]} for group in mixed_opt.param_groups]
        assert sorted(kinds, key=lambda kind: True in kind) == [{False}, {True}]
        got = model(input_ids=ids, labels=ids).loss
        got.backward()
        want = unwrapped(input_ids=ids, labels=ids).loss
        want.backward()
        assert got.item() == want.item()
        grad = router.weight.grad.full_tensor()
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, unwrapped.model.layers[1].mlp.gate.weight.grad)
        step()


def test_multi_gpu_table_and_plot_from_the_saved_rows(tmp_path):
    """The docs' multi-GPU table: one line per row (shape, engine and the FSDP2 settings it changed, GPUs),
    hf-scatter against the family default of that row, and the scaling plot, from the file
    scripts/bench-train-multi-gpu.sh writes."""
    from hf_scatter.bench.train import plot_scaling, scaling_table

    combined = json.loads((RESULTS / "train-multi-gpu-h100.json").read_text())
    lines = [line for line in scaling_table(combined).splitlines() if line.startswith("| ")][1:]  # no header
    assert len(lines) == len(combined["rows"])
    for line, report in zip(lines, combined["rows"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        res = report["results"]
        ours = next(r for k, r in res.items() if k.endswith("-hf-scatter"))
        default = next(r for k, r in res.items() if not k.endswith("-hf-scatter"))
        assert [cells[1].split(" (")[0], cells[2]] == [report["engine"], str(report["world"])]
        options = report.get("fsdp2") or {}  # a row that changed FSDP2's settings names them
        assert ("bf16 reduce" in cells[1]) == (options.get("reduce_dtype") == "bfloat16")
        assert ("kept after forward" in cells[1]) == (options.get("reshard_after_forward") is False)
        assert cells[6] == f"{ours['tokens_per_s'] / default['tokens_per_s']:.2f}x"
        # the last column: hf-scatter's fastest measured batch within the default's peak memory per GPU
        within = [e for e in ours["batch_sweep"] if e.get("tokens_per_s") and e["peak_gib"] <= default["peak_gib"]]
        best = max(within, key=lambda e: e["tokens_per_s"])
        rows, ratio, peak = cells[-1].split(", ")
        assert int(rows) == best["rows_per_rank"] and float(peak) <= default["peak_gib"] + 0.05
        assert ratio == f"{best['tokens_per_s'] / default['tokens_per_s']:.2f}x" and float(ratio[:-1]) > 1
    plot_scaling(combined, str(tmp_path / "scaling.png"))
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multi_gpu_table_leaves_out_a_row_without_both_sides(tmp_path):
    """A row whose default ran out of memory at every batch (or that stopped before hf-scatter ran) has no
    ratio to show: the table says it left the row out, and the plot draws the others."""
    from hf_scatter.bench.train import plot_scaling, scaling_table

    combined = json.loads((RESULTS / "train-multi-gpu-h100.json").read_text())
    first = combined["rows"][1]
    combined["rows"][1] = {**first, "results": {k: v for k, v in first["results"].items()
                                               if k.endswith("-hf-scatter")}}
    table = scaling_table(combined)
    assert len([line for line in table.splitlines() if line.startswith("| ")]) - 1 == len(combined["rows"]) - 1
    assert "Rows without figures for both sides (left out): qwen3-30b-a3b, 8 layers, fsdp2, 1 GPUs." in table
    plot_scaling(combined, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").exists()


def test_call_costs_table_shows_host_gpu_time_and_launches_of_decode_calls():
    from hf_scatter.bench.moe import call_costs_table

    report = {"results": {
        "qwen3-decode": {"hf-scatter": {"fwd_ms": 0.48, "host_ms": 0.26, "gpu_ms": 0.475, "launches": 5.0},
                         "hf-eager": {"fwd_ms": 38.0, "host_ms": 37.5, "launches": 1200.0},
                         "dense": {"fwd_ms": 0.05, "host_ms": 0.02, "gpu_ms": 0.05, "launches": 3.0}},
        "qwen3-30b-a3b": {"hf-scatter": {"fwd_ms": 3.1, "fwdbwd_ms": 9.5}}}}
    rows = [line for line in call_costs_table(report).splitlines()[2:]]
    assert rows == ["| qwen3-decode | hf-eager | 38.000 | 37.500 |  | 1200 |",
                    "| qwen3-decode | **hf-scatter** | 0.480 | 0.260 | 0.475 | 5 |",
                    "| qwen3-decode | dense | 0.050 | 0.020 | 0.050 | 3 |"]


@pytest.mark.gpu
def test_decode_call_costs_of_the_patched_experts_are_four_launches():
    """A decode-sized call of hf-scatter's experts is four kernel launches (routing sort with the tile table,
    the first expert GEMM with the SwiGLU in its epilogue, the second, gate mix): its host time is what bounds
    decode on most hosts."""
    from hf_scatter.bench import moe

    cfg = moe.MoEConfig(hidden=256, intermediate=128, experts=32, top_k=4, tokens=16, backward=False)
    experts = moe.hf_experts(cfg, "cuda", torch.bfloat16)
    x, idx, gates, _ = moe.routed_batch(cfg.tokens, cfg.hidden, cfg.experts, cfg.top_k, "cuda", torch.bfloat16)
    fn, _ = moe._implementations(cfg, experts, "cuda", torch.bfloat16, False)["hf-scatter"]
    costs = moe._call_costs("hf-scatter", fn, x, idx, gates, calls=10)
    assert costs["launches"] == 4 and costs["gpu_ms"] > 0 and costs["host_ms"] > 0


@pytest.mark.gpu
def test_bench_train_smoke_run_patched_matches_vanilla_first_loss():
    import importlib.util

    from hf_scatter.bench import train

    liger = importlib.util.find_spec("liger_kernel") is not None  # a peer, not a dependency
    impls = [impl for impl in train.IMPLS if liger or not impl.endswith("-liger")]
    report = train.run(impls, cfg=train.SMOKE, warmup=1, steps=2, liger_autotune="off")
    res = report["results"]
    assert set(res) == set(impls)
    for impl, r in res.items():  # every variant of a family computes its vanilla first loss
        vanilla = res[train.BASELINES[impl.split("-", 1)[0]]]["first_step_loss"]
        assert abs(r["first_step_loss"] - vanilla) < 2e-2 * vanilla, impl
    assert all(r["tokens_per_s"] > 0 and r["peak_gib"] > 0 for r in res.values())
    # every eager variant gets its breakdown; the graphed ones cannot (the breakdown's hooks send graphed
    # blocks eager, so it would time the eager step under the graphed name)
    for impl, r in res.items():
        assert ("breakdown_ms" in r or "breakdown_error" in r) == (not impl.endswith("-graphs")), impl
    for family in ("mixtral", "dbrx", "qwen3_moe", "deepseek_v3"):  # graphed steps: the eager patch's first loss
        graphs = res[f"{family}-hf-scatter-graphs"]["first_step_loss"]
        assert abs(graphs - res[f"{family}-hf-scatter"]["first_step_loss"]) < 1e-2 * graphs


def test_bench_train_fsdp_refuses_variants_that_cannot_run_sharded():
    from hf_scatter.bench import train

    for impl in ("mixtral-liger", "mixtral-hf-scatter-graphs"):
        with pytest.raises(ValueError, match="--engine fsdp2: .*leave them out of --configs"):
            train.run(["mixtral-grouped_mm", impl], cfg=train.SMOKE, fsdp=True)


def test_bench_train_batch_replaces_every_familys_batch_and_nothing_else():
    from hf_scatter.bench import train

    for family, shape in train.FAMILY_SHAPES.items():
        bigger = train.family_shape(f"{family}-hf-scatter", None, batch=16)
        assert bigger.batch == 16 and bigger.tokens == 16 * shape.seq
        assert dataclasses.replace(bigger, batch=shape.batch) == shape
    assert train.family_shape("mixtral-grouped_mm", train.SMOKE) == train.SMOKE
    assert train.family_shape("mixtral-grouped_mm", train.SMOKE, batch=3).batch == 3


@pytest.mark.gpu
def test_bench_train_fsdp_smoke_run_keeps_each_variants_first_loss():
    """Under FSDP2 (world size 1) every variant computes the first loss it computes unwrapped."""
    from hf_scatter.bench import train

    impls = ["mixtral-grouped_mm", "mixtral-hf-scatter", "dbrx-eager", "dbrx-hf-scatter", "qwen3_moe-hf-scatter"]
    plain = train.run(impls, cfg=train.SMOKE, warmup=1, steps=2, breakdown=False)["results"]
    sharded = train.run(impls, cfg=train.SMOKE, warmup=1, steps=2, fsdp=True)
    assert sharded["fsdp"] is True
    for impl in impls:
        r = sharded["results"][impl]
        assert abs(r["first_step_loss"] - plain[impl]["first_step_loss"]) < 1e-2 * r["first_step_loss"], impl
        assert r["tokens_per_s"] > 0 and "breakdown_ms" not in r


def test_bench_convert_runs_on_the_cpu_and_writes_json_table_png(tmp_path, monkeypatch, capsys):
    from hf_scatter.bench import convert

    monkeypatch.setitem(convert.MIXTRAL_8X7B, "hidden", 64)
    monkeypatch.setitem(convert.MIXTRAL_8X7B, "intermediate", 96)
    monkeypatch.setitem(convert.MIXTRAL_8X7B, "vocab", 384)
    out, png = tmp_path / "convert.json", tmp_path / "convert.png"
    assert main(["bench", "convert", "--layers", "1", "--workdir", str(tmp_path), "--out", str(out),
                 "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert set(report["load_s"]) == set(convert.LOADS) and report["convert_gb_per_s"] > 0
    assert all(report["load_and_touch_s"][k] >= report["load_s"][k] for k in convert.LOADS)
    assert "patched <- hf-scatter checkpoint" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["convert.json", "convert.png"], "checkpoints left behind"


@pytest.mark.parametrize("family,shared,shipped", [("mixtral", 0, None), ("mixtral", 2, None), ("gpt_oss", 0, "mxfp4"),
                                                   ("mixtral", 0, "fp8")])
def test_bench_moe_peers_compute_the_same_layer(family, shared, shipped):
    """Every implementation bench moe times computes transformers' eager experts (plus the same shared
    experts), so the timings compare one computation; peers that cannot run the family say why. In inference,
    GPT-OSS layers (dimensions in groups of 32) also run on MXFP4 weights and SwiGLU layers (dimensions in
    blocks of 128) on FP8 ones, every peer on the same quantized values."""
    from hf_scatter.bench import moe

    size = {None: (24, 20), "mxfp4": (64, 32), "fp8": (128, 128)}[shipped]
    cfg = moe.MoEConfig(hidden=size[0], intermediate=size[1], experts=5, top_k=2, tokens=9, shared_experts=shared,
                        family=family, backward=shipped is None)
    torch.manual_seed(0)
    experts = moe.hf_experts(cfg, "cpu", torch.float32)
    x, idx, gates, _ = moe.routed_batch(cfg.tokens, cfg.hidden, cfg.experts, cfg.top_k, "cpu", torch.float32)
    table = moe._implementations(cfg, experts, "cpu", torch.float32)
    assert set(table) == set(moe.IMPLS)
    ref = table["hf-eager"][0](x, idx, gates)
    assert ref.abs().max() > 0
    for impl in ("hf-grouped_mm", "hf-scatter") + ((f"hf-scatter-{shipped}",) if shipped else ()):
        torch.testing.assert_close(table[impl][0](x, idx, gates), ref, rtol=1e-4, atol=1e-5, msg=impl)
    for other in {"mxfp4", "fp8"} - {shipped}:
        assert table[f"hf-scatter-{other}"].startswith("n/a")
    if family == "gpt_oss":
        assert table["liger"].startswith("n/a")
    assert table["sonicmoe"].startswith("n/a")  # a Hopper-only peer says why it sits out, on any other device
    dense, params = table["dense"]
    assert dense(x, idx, gates).shape == ref.shape
    # equal active FLOPs: as many weights as the (k + shared) experts a token passes through
    assert sum(p.numel() for p in params) == 3 * (cfg.top_k + shared) * cfg.intermediate * cfg.hidden


def test_sonicmoe_import_failure_names_the_folder_a_target_install_left_off_the_path(tmp_path, monkeypatch):
    """SonicMoE installed with ``pip --target`` imports without its CuTe DSL's ``cutlass`` package (its .pth is
    skipped): the peer's row says which folder to put on PYTHONPATH; other import failures keep their own reason."""
    from hf_scatter.bench import moe

    packages = tmp_path / "nvidia_cutlass_dsl" / "python_packages"
    (packages / "cutlass").mkdir(parents=True)
    monkeypatch.setattr(moe.sys, "path", [str(tmp_path)] + moe.sys.path)
    missing = ModuleNotFoundError("No module named 'cutlass'", name="cutlass")
    reason = moe._sonicmoe_import_failure(missing)
    assert reason.startswith("not importable (ModuleNotFoundError: No module named 'cutlass')")
    assert f"add {packages} to PYTHONPATH" in reason
    other = moe._sonicmoe_import_failure(ImportError("libcuda.so.1: cannot open shared object file"))
    assert other == "not importable (ImportError: libcuda.so.1: cannot open shared object file)"
    monkeypatch.setattr(moe.sys, "path", [str(tmp_path / "elsewhere")])
    assert "PYTHONPATH" not in moe._sonicmoe_import_failure(missing)  # not installed at all: no folder to name


def test_plots_and_results_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A plot whose writing fails half-way (a full disk) leaves the previous file as it was and no temporary
    file; a good one replaces it. The same for JSON results (a value JSON cannot hold)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image
    import matplotlib.pyplot as plt

    from hf_scatter.common.atomic_files import save_figure, write_json

    def disk_full(fname, *args, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError(28, "No space left on device")

    path = tmp_path / "plot.png"
    path.write_bytes(b"previous")
    fig, ax = plt.subplots()
    with monkeypatch.context() as m:
        m.setattr(matplotlib.image, "imsave", disk_full)
        with pytest.raises(OSError, match="No space"):
            save_figure(fig, path)
    assert path.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    assert not plt.get_fignums(), "the failed figure stays open"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    save_figure(fig, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = tmp_path / "r.json"
    write_json(result, {"a": 1})
    with pytest.raises(TypeError):
        write_json(result, {"a": object()})
    assert result.read_text() == '{\n "a": 1\n}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "r.json"]


# --- bench train under the distributed engines: 2 CPU processes (gloo), the smoke shape ---------------------------

VARIANTS = ["qwen3_moe-grouped_mm", "qwen3_moe-hf-scatter"]  # transformers' default and the patch
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _engines_worker(rank: int, init_file: str, baseline: str, out: str, port: int) -> None:
    """Every engine in turn in one pair of processes (starting them is most of the cost): first the command line
    as torchrun starts it (its environment, no process group yet: the command makes it), then each engine's run."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", DS_ACCELERATOR="cpu",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if HAS_DEEPSPEED:
        import deepspeed.ops

        # DeepSpeed's shared-memory all-reduce for CPU would be compiled at start-up (half a minute): gloo does it.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from hf_scatter.bench import train

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["bench", "train", "--engine", "fsdp2", "--shape", "smoke", "--configs", *VARIANTS, "--steps",
                     "1", "--no-comm-profile", "--out", f"{out}.cli.json"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        found = {"cli": {"code": code, "printed": printed.getvalue()}}
        for engine in ("fsdp2", "ep") + (("zero3",) if HAS_DEEPSPEED else ()):
            found[engine] = train.run(VARIANTS, shape="smoke", device="cpu", engine=engine, warmup=1, steps=1,
                                      baseline=baseline if engine == "fsdp2" else None,
                                      comm_profile=engine == "fsdp2")  # asked once: on the CPU, "not measured"
        try:
            train.run(VARIANTS, shape="smoke", device="cpu")
        except ValueError as error:
            found["none"] = str(error)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(found, f)  # the reports are JSON: that is how --out writes them
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    """(one unwrapped process's report, each rank's reports of the 2-process runs under each engine)."""
    from hf_scatter.bench import train
    from hf_scatter.common.atomic_files import write_json

    tmp = tmp_path_factory.mktemp("engines")
    with pytest.MonkeyPatch.context() as env:
        # What is at stake is the engines' set-up and the ranks' numbers, not the kernels (tested elsewhere): the
        # patch's torch reference path, not the Triton interpreter; the CPU and gloo, also on a GPU machine.
        env.setenv("HF_SCATTER_KERNELS", "torch")
        env.setenv("CUDA_VISIBLE_DEVICES", "")
        reference = train.run(VARIANTS, shape="smoke", device="cpu", warmup=1, steps=2)
        write_json(tmp / "baseline.json", reference, default=float)
        port = free_port()  # the command line's rendezvous, as torchrun's MASTER_PORT
        mp.start_processes(_engines_worker, args=(str(tmp / "init"), str(tmp / "baseline.json"), str(tmp / "r"), port),
                           nprocs=2, start_method="spawn", join=True)
    ranks = [json.loads((tmp / f"r.{rank}").read_text()) for rank in range(2)]
    ranks[0]["cli"]["report"] = json.loads((tmp / "r.cli.json").read_text())
    ranks[0]["cli"]["files"] = sorted(p.name for p in tmp.iterdir() if p.name.startswith("r.cli"))
    return reference, ranks


def _check_ranks(report: dict, engine: str) -> None:
    """Both ranks' numbers are in rank 0's report, the per-variant figures are computed from them, and the
    patched model's first-step loss is the vanilla one's on every rank."""
    from hf_scatter.bench import train

    assert (report["engine"], report["world"], report["rows_per_rank"]) == (engine, 2, train.SMOKE.batch)
    shared = report["shared_batch"]
    for impl in VARIANTS:
        r = report["results"][impl]
        ranks = r["ranks"]
        assert [x["rank"] for x in ranks] == [0, 1] and (r["engine"], r["world"]) == (engine, 2)
        for x in ranks:
            assert x["tokens"] == train.SMOKE.tokens / (2 if shared else 1)
            assert x["tokens_per_s"] == pytest.approx(x["tokens"] / (x["step_ms_median"] / 1e3))
            assert 0 < x["host_issue_ms_median"] <= x["step_ms_median"]  # the CPU: the step is all host
            assert x["peak_gib"] is None and x["comm_ms"] == "not measured"  # no GPU: no memory, no GPU kernels
        assert r["tokens_per_s"] == pytest.approx((ranks[0]["tokens_per_s"] + ranks[1]["tokens_per_s"]) / 2)
        assert r["step_ms_median"] == max(x["step_ms_median"] for x in ranks)
        assert r["host_issue_ms_median"] == max(x["host_issue_ms_median"] for x in ranks)
        assert r["first_step_loss"] == pytest.approx((ranks[0]["first_step_loss"] + ranks[1]["first_step_loss"]) / 2)
        assert r["model_flops_per_step"] == pytest.approx(sum(x["model_flops"] for x in ranks))
    for rank in range(2):  # patched vs vanilla on the same rows: float32, so within rounding
        losses = [report["results"][impl]["ranks"][rank]["first_step_loss"] for impl in VARIANTS]
        assert losses[1] == pytest.approx(losses[0], rel=1e-4), rank
    table = train.to_markdown(report)
    assert all(f"| {impl} | {engine} | 2 | {train.SMOKE.batch} |" in table for impl in VARIANTS), table


def test_bench_train_under_fsdp2_on_two_processes(engine_runs, tmp_path, capsys):
    """Each rank trains on its own rows (their first losses differ), rank 0's model is the unwrapped one (its
    first loss is one process's on the same rows), only rank 0 returns the report, the efficiency against the
    one-process --baseline is the per-GPU tokens/s over the baseline's, and the saved report re-renders."""
    reference, ranks = engine_runs
    report = ranks[0]["fsdp2"]
    assert ranks[1]["fsdp2"] is None
    _check_ranks(report, "fsdp2")
    assert report["fsdp"] is True and report["fsdp2"] == {"reshard_after_forward": True, "reduce_dtype": "float32",
                                                          "prefetch": "none"}
    for impl in VARIANTS:
        r, base = report["results"][impl], reference["results"][impl]
        assert r["ranks"][0]["first_step_loss"] == pytest.approx(base["first_step_loss"], rel=1e-5)
        assert r["ranks"][1]["first_step_loss"] != pytest.approx(base["first_step_loss"], rel=1e-3)
        assert r["efficiency"] == pytest.approx(r["tokens_per_s"] / base["tokens_per_s"])
    assert report["baseline"]["path"].endswith("baseline.json")
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert main(["bench", "train", "--replot", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]) == 0
    assert "| scaling efficiency |" in capsys.readouterr().out
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_train_under_expert_parallelism_on_two_processes(engine_runs):
    report = engine_runs[1][0]["ep"]
    assert engine_runs[1][1]["ep"] is None
    _check_ranks(report, "ep")
    assert report["distributed_config"]["ep_size"] == 2
    assert all("efficiency" not in r for r in report["results"].values())  # no --baseline: none invented


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (pip install -e '.[dev]')")
def test_bench_train_under_deepspeed_zero3_on_two_processes(engine_runs):
    reference, ranks = engine_runs
    report = ranks[0]["zero3"]
    assert ranks[1]["zero3"] is None
    _check_ranks(report, "zero3")
    assert report["deepspeed_config"]["zero_optimization"] == {"stage": 3}


def test_bench_train_refuses_an_unwrapped_run_on_several_processes(engine_runs):
    assert all("--engine none runs one unwrapped process, but this run has 2" in ranks["none"]
               for ranks in engine_runs[1])


def test_bench_train_per_variant_figures_from_synthetic_ranks():
    """Means over the ranks for throughput and model TFLOP/s, the largest rank for step time, memory and
    communication, the mean loss; a rank without GPU kernels makes the variant's communication unmeasured."""
    from hf_scatter.bench.engines import aggregate

    def rank(i, tokens_per_s, step_ms, peak, reserved, loss, comm):
        return {"rank": i, "tokens": 4096, "tokens_per_s": tokens_per_s, "tflops": tokens_per_s / 1e3,
                "model_flops": 1e12, "step_ms_median": step_ms, "step_ms_all": [step_ms], "peak_gib": peak,
                "peak_reserved_gib": reserved, "first_step_loss": loss, "comm_ms": comm,
                "host_issue_ms_median": step_ms / 2 + i}

    comm = [{"nccl_ms": 10.0, "compute_ms": 90.0, "exposed_comm_ms": 2.0},
            {"nccl_ms": 12.0, "compute_ms": 80.0, "exposed_comm_ms": 1.0}]
    ranks = [rank(0, 40000.0, 102.4, 30.0, 34.0, 2.0, comm[0]), rank(1, 30000.0, 136.5, 32.0, 33.0, 3.0, comm[1])]
    r = aggregate(ranks)
    assert (r["tokens_per_s"], r["tokens_per_s_all_gpus"], r["tflops_per_gpu"]) == (35000.0, 70000.0, 35.0)
    assert (r["step_ms_median"], r["peak_gib"], r["peak_reserved_gib"]) == (136.5, 32.0, 34.0)
    assert r["host_issue_ms_median"] == 136.5 / 2 + 1
    assert (r["first_step_loss"], r["model_flops_per_step"], r["ranks"]) == (2.5, 2e12, ranks)
    assert r["comm_ms"] == {"nccl_ms": 12.0, "compute_ms": 90.0, "exposed_comm_ms": 2.0}
    ranks[1]["comm_ms"] = "not measured"
    assert aggregate(ranks)["comm_ms"] == "not measured"
    del ranks[0]["host_issue_ms_median"]  # a report from before the host time was kept: unknown, not a rank's
    assert aggregate(ranks)["host_issue_ms_median"] is None


def test_bench_train_batch_sweep_skips_every_batch_the_measured_memory_says_will_not_fit():
    """Peak memory predicted linearly in the batch, the largest rank's: after one batch, above what lives across
    steps (30 GiB resident, a 50 GiB peak at 4 rows: 70 at 8 fits 92% of 80, 110 at 16 does not); after two,
    through both peaks (44 at 2 and 50 at 4 rows: 62 at 8 fits where the resident line says 70); a rank whose
    peak was higher decides for all; on the CPU (no peak) nothing is skipped."""
    from hf_scatter.bench import train

    def measured(rows, peaks, resident=30.0, capacity=80.0):
        return {"rows_per_rank": rows, "ranks": [{"peak_gib": p, "resident_gib": resident, "capacity_gib": capacity}
                                                 for p in peaks]}

    assert train._will_not_fit([measured(4, [50.0, 48.0])], 8) is None
    why = train._will_not_fit([measured(4, [50.0, 48.0])], 16)
    assert "predicted peak 110.0 GiB per GPU over 73.6 GiB" in why
    assert train._will_not_fit([measured(4, [48.0, 53.0])], 8) is not None  # 30 + 23 x 2 = 76 > 73.6
    two = [measured(2, [44.0, 43.0]), measured(4, [50.0, 49.0])]
    assert train._will_not_fit(two, 8) is None and train._will_not_fit(two, 10) is None  # 62, 68
    assert "predicted peak 74.0 GiB" in train._will_not_fit(two, 12)
    assert train._will_not_fit([measured(4, [None, None], resident=None, capacity=None)], 64) is None


def test_bench_train_batch_sweep_reports_each_variant_at_its_fastest_batch(monkeypatch, capsys):
    """--batch 1 2: each variant ran at both (smallest first), its figures are its fastest batch's, every
    batch's are kept, the table says the rows."""
    from hf_scatter.bench import train

    monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
    report = train.run(VARIANTS, shape="smoke", device="cpu", batch=[2, 1], warmup=1, steps=1, breakdown=False)
    assert report["rows_per_rank"] == [1, 2]
    for impl in VARIANTS:
        r = report["results"][impl]
        assert [e["rows_per_rank"] for e in r["batch_sweep"]] == [1, 2]
        fastest = max(r["batch_sweep"], key=lambda e: e["tokens_per_s"])
        assert (r["rows_per_rank"], r["tokens_per_s"]) == (fastest["rows_per_rank"], fastest["tokens_per_s"])
        assert [e["ranks"][0]["tokens"] for e in r["batch_sweep"]] == [train.SMOKE.seq, 2 * train.SMOKE.seq]
    assert "fastest at" in capsys.readouterr().out
    assert f"| {VARIANTS[0]} | none | 1 |" in train.to_markdown(report)


def test_a_sweep_stopped_by_out_of_memory_keeps_and_writes_what_ran(monkeypatch, tmp_path, capsys):
    """Under several processes one batch out of memory stops the run (the ranks would wait on each other): the
    command still writes the batches measured before it, says where it stopped, and exits 1."""
    import torch

    from hf_scatter.bench import train

    monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
    real = train._run_rows

    def runs_out_at_two_rows(report, impl, shape, *args, **kwargs):  # as _run_rows does on several ranks
        if shape.batch == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.91 GiB")
        return real(report, impl, shape, *args, **kwargs)

    monkeypatch.setattr(train, "_run_rows", runs_out_at_two_rows)
    out = tmp_path / "r.json"
    code = main(["bench", "train", "--shape", "smoke", "--configs", VARIANTS[1], "--batch", "1", "2", "4",
                 "--steps", "1", "--no-breakdown", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "ran out of memory at 2 rows per GPU" in err and "--batch below 2" in err
    report = json.loads(out.read_text())
    r = report["results"][VARIANTS[1]]
    assert r["rows_per_rank"] == 1 and [e["rows_per_rank"] for e in r["batch_sweep"]] == [1, 2]
    assert r["batch_sweep"][1]["skipped"].startswith("out of memory") and "stopped" in report


def test_bench_train_baseline_of_a_sweep_needs_one_batch_in_common(tmp_path):
    from hf_scatter.bench import train

    report = {"config": dataclasses.asdict(train.SMOKE), "results": {"qwen3_moe-hf-scatter": {"tokens_per_s": 1.0}}}
    (tmp_path / "b.json").write_text(json.dumps(report))
    train.check_flags(shape="smoke", impls=["qwen3_moe-hf-scatter"], batch=[train.SMOKE.batch, 8],
                      baseline=str(tmp_path / "b.json"))
    sweep = {"config": dataclasses.asdict(train.SMOKE), "results": {"qwen3_moe-hf-scatter": {
        "tokens_per_s": 2.0, "rows_per_rank": 8, "batch_sweep": [{"rows_per_rank": 2, "tokens_per_s": 1.0},
                                                                   {"rows_per_rank": 8, "tokens_per_s": 2.0}]}}}
    (tmp_path / "s.json").write_text(json.dumps(sweep))  # one batch against a sweep that ran it: taken
    train.check_flags(shape="smoke", impls=["qwen3_moe-hf-scatter"], batch=8, baseline=str(tmp_path / "s.json"))
    with pytest.raises(ValueError, match=r"another shape or batch there .* rows \[3, 8\]"):
        train.check_flags(shape="smoke", impls=["qwen3_moe-hf-scatter"], batch=[3, 8],
                          baseline=str(tmp_path / "b.json"))
    assert train._rows_tokens_per_s({"tokens_per_s": 5.0, "rows_per_rank": 8, "batch_sweep": [
        {"rows_per_rank": 4, "tokens_per_s": 3.0}, {"rows_per_rank": 8, "tokens_per_s": 5.0},
        {"rows_per_rank": 16, "skipped": "out of memory"}]}, 4, 4) == 3.0


def test_comm_split_counts_communication_no_kernel_overlaps():
    """NCCL kernels 0-10 and 20-30 us, compute on two streams 5-15 and 8-25: 20 us of NCCL, 20 of compute
    (5-25), and 10 exposed (0-5 and 25-30), per step over 2 steps: in ms."""
    from hf_scatter.bench.engines import comm_split

    kernels = [("ncclDevKernel_AllGather_RING_LL", 0.0, 10.0), ("ncclKernel_ReduceScatter", 20.0, 30.0),
               ("sm90_xmma_gemm", 5.0, 15.0), ("triton_scatter2scatter", 8.0, 25.0)]
    assert comm_split(kernels, steps=2) == pytest.approx({"nccl_ms": 0.01, "compute_ms": 0.01,
                                                          "exposed_comm_ms": 0.005})
    assert comm_split([], steps=2) == "not measured"


def test_model_flops_of_qwen3_30b_a3b_by_hand():
    """Qwen3-30B-A3B (d 2048, 32 query heads and 4 KV heads of 128, 128 experts of 768, top 8, vocabulary
    151,936, 48 layers) at 4096 tokens: per token and layer, Q K V O projections 2048 x (4096 + 2 x 512) +
    4096 x 2048, the causal half of QK^T and PV 4096 x 4096, the 8 experts' SwiGLU 3 x 2048 x 8 x 768, the router
    2048 x 128; the LM head 2048 x 151,936; 6 FLOPs per multiply-add and token for forward and backward."""
    from hf_scatter.bench.train import model_flops
    from hf_scatter.offload import ModelSpec

    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048 + 4096 * 4096
    experts, router = 3 * 2048 * 8 * 768, 2048 * 128
    per_token = 48 * (attention + experts + router) + 2048 * 151936
    spec = ModelSpec.from_config("qwen3-30b-a3b")
    assert model_flops(spec, seq=4096, sequences=2) == 6 * per_token * 4096 * 2
    # Megatron-LM's count is the same but the router: 23.0 GFLOP per token, what NeMo AutoModel's published
    # 277 TFLOP/s at 12,040 tokens/s per GPU works out to
    megatron = model_flops(spec, 4096) - 6 * 48 * router * 4096
    assert megatron / 4096 == pytest.approx(277e12 / 12040, rel=2e-3)


def test_model_flops_of_deepseek_v2_lite_by_hand():
    """DeepSeek-V2-Lite: MLA (16 heads, no query low rank, latent 512, rotary 64, nope and value 128), a dense
    first layer of 10,944, 26 MoE layers of 6 of 64 experts of 1408 plus 2 shared, vocabulary 102,400."""
    from hf_scatter.bench.train import model_flops
    from hf_scatter.offload import ModelSpec

    s = 2048
    attention = (2048 * 16 * 192 + 2048 * (512 + 64) + 512 * 16 * (128 + 128) + 16 * 128 * 2048
                 + s / 2 * 16 * (192 + 128))
    moe = 3 * 2048 * (6 * 1408 + 2 * 1408) + 2048 * 64
    per_token = 27 * attention + 26 * moe + 3 * 2048 * 10944 + 2048 * 102400
    assert model_flops(ModelSpec.from_config("deepseek-v2-lite"), seq=s) == pytest.approx(6 * per_token * s)


def test_bench_train_shapes_are_the_published_models_with_the_layers_asked():
    from hf_scatter.bench import train

    qwen = train.published_shape("qwen3-30b-a3b", layers=8)
    assert (qwen.hidden, qwen.heads, qwen.kv_heads, qwen.head_dim, qwen.vocab, qwen.layers) == (
        2048, 32, 4, 128, 151936, 8)
    config = train._hf_config("qwen3_moe", qwen)
    assert (config.head_dim, config.num_attention_heads, config.num_hidden_layers, config.num_experts) == (
        128, 32, 8, 128)
    assert train.published_shape("deepseek-v2-lite").layers == 27  # the full model
    plan = train._plan(shape="gpt-oss-120b", layers=4, batch=8)
    assert plan.impls == ["gpt_oss-grouped_mm", "gpt_oss-hf-scatter"]
    assert {(s.layers, s.experts, s.batch, s.preset) for s in plan.shapes.values()} == {(4, 128, 8, "gpt-oss-120b")}


@pytest.mark.parametrize("flags, env, message", [
    (dict(shape="qwen3-31b"), {}, "unknown --shape 'qwen3-31b'"),
    (dict(shape="qwen3-30b-a3b", impls=["mixtral-hf-scatter"]), {}, "for --shape qwen3-30b-a3b (a qwen3_moe model)"),
    (dict(engine="none"), {"WORLD_SIZE": "2", "RANK": "0"}, "--engine none runs one unwrapped process"),
    (dict(engine="ep", impls=["mixtral-hf-scatter"]), {}, "--engine ep runs under torchrun"),
    (dict(engine="ep", shape="smoke", impls=["qwen3_moe-hf-scatter"]), {"WORLD_SIZE": "3", "RANK": "0"},
     "qwen3_moe-hf-scatter has 4 experts, which 3 processes cannot split evenly"),
    (dict(engine="ep", shape="smoke", impls=["dbrx-hf-scatter"]), {"WORLD_SIZE": "2", "RANK": "0"},
     "no expert-parallel plan for dbrx-hf-scatter"),
    (dict(engine="ep", fsdp=True), {}, "--fsdp is --engine fsdp2"),
    (dict(engine="zero3", impls=["mixtral-hf-scatter-graphs"]), {}, "leave them out of --configs"),
    (dict(prefetch="next"), {}, "they go with --engine fsdp2"),
])
def test_bench_train_refuses_what_cannot_run_before_building_anything(flags, env, message, monkeypatch):
    from hf_scatter.bench import train

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(train, "build_model", None)  # nothing may be built
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train.run(**flags)


def test_bench_train_zero3_without_deepspeed_is_refused(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else
                        find_spec(name, *a))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    try:
        rc = main(["bench", "train", "--engine", "zero3", "--shape", "smoke"])
    except SystemExit as exit_:
        rc = exit_.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.splitlines() == [err]
    assert "--engine zero3 needs deepspeed (pip install deepspeed)" in err


def test_bench_train_baseline_of_another_run_is_refused(tmp_path):
    from hf_scatter.bench import train

    report = {"world": 2, "engine": "fsdp2", "results": {}}
    (tmp_path / "b.json").write_text(json.dumps(report))
    with pytest.raises(ValueError, match="the reference is one unwrapped process"):
        train.check_flags(shape="smoke", baseline=str(tmp_path / "b.json"))
    report = {"config": dataclasses.asdict(train.SMOKE), "results": {"qwen3_moe-hf-scatter": {"tokens_per_s": 1.0}}}
    (tmp_path / "b.json").write_text(json.dumps(report))
    train.check_flags(shape="smoke", impls=["qwen3_moe-hf-scatter"], baseline=str(tmp_path / "b.json"))
    with pytest.raises(ValueError, match="qwen3_moe ran at another shape or batch there"):
        train.check_flags(shape="smoke", impls=["qwen3_moe-hf-scatter"], batch=3, baseline=str(tmp_path / "b.json"))


def test_bench_train_command_under_torchrun_writes_and_prints_on_rank_0_only(engine_runs):
    """The real command in torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, no group yet): rank 0
    prints one table and writes one report holding both ranks' numbers; rank 1 prints and writes nothing."""
    cli = [rank["cli"] for rank in engine_runs[1]]
    assert [c["code"] for c in cli] == [0, 0]
    assert cli[0]["printed"].count("| variant | engine |") == 1 and cli[1]["printed"] == ""
    assert cli[0]["files"] == ["r.cli.json"]
    assert [x["rank"] for x in cli[0]["report"]["results"][VARIANTS[1]]["ranks"]] == [0, 1]


def test_offload_gpu_rows_cut_short_by_sigterm_keep_the_finished_rows(tmp_path):
    """``bench offload --gpus`` under ``timeout``: the row running when SIGTERM comes is stopped (its process
    too), and the rows before it are kept for the report."""
    import signal
    import sys
    import threading
    import time

    from hf_scatter.bench.offload_gpus import RowsStopped, run_rows

    done, slow = tmp_path / "one.json", tmp_path / "slow.pid"
    write = f"import json; json.dump({{'by_gpus': [{{'gpus': 1, 'tokens_per_s': 5.0}}]}}, open({str(done)!r}, 'w'))"
    hang = f"import os, time; open({str(slow)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    jobs = [(1, [sys.executable, "-c", write], dict(os.environ), str(done)),
            (2, [sys.executable, "-c", hang], dict(os.environ), str(tmp_path / "never.json"))]

    def stop_when_the_slow_row_runs():
        deadline = time.monotonic() + 60
        while not slow.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=stop_when_the_slow_row_runs, daemon=True).start()
    with pytest.raises(RowsStopped, match="during the 2-GPU row") as stopped:
        run_rows(jobs, progress=False)
    assert stopped.value.rows == [{"gpus": 1, "tokens_per_s": 5.0}]
    pid = int(slow.read_text())
    with pytest.raises(ProcessLookupError):  # the running row's process was stopped and reaped
        os.kill(pid, 0)
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back
