"""Benchmarks: re-rendering saved results works anywhere; a tiny training-step run works on the GPU."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from hf_scatter.cli import main

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


@pytest.mark.parametrize("suite,saved", [("moe", "moe-h200.json"), ("train", "train-h200.json"),
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
        with pytest.raises(ValueError, match="--fsdp: .*leave them out of --configs"):
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


@pytest.mark.parametrize("family,shared", [("mixtral", 0), ("mixtral", 2), ("gpt_oss", 0)])
def test_bench_moe_peers_compute_the_same_layer(family, shared):
    """Every implementation bench moe times computes transformers' eager experts (plus the same shared
    experts), so the timings compare one computation; peers that cannot run the family say why."""
    from hf_scatter.bench import moe

    cfg = moe.MoEConfig(hidden=24, intermediate=20, experts=5, top_k=2, tokens=9, shared_experts=shared,
                        family=family)
    torch.manual_seed(0)
    experts = moe.hf_experts(cfg, "cpu", torch.float32)
    x, idx, gates, _ = moe.routed_batch(cfg.tokens, cfg.hidden, cfg.experts, cfg.top_k, "cpu", torch.float32)
    table = moe._implementations(cfg, experts, "cpu", torch.float32)
    assert set(table) == set(moe.IMPLS)
    ref = table["hf-eager"][0](x, idx, gates)
    assert ref.abs().max() > 0
    for impl in ("hf-grouped_mm", "hf-scatter"):
        torch.testing.assert_close(table[impl][0](x, idx, gates), ref, rtol=1e-4, atol=1e-5, msg=impl)
    if family == "gpt_oss":
        assert table["liger"].startswith("n/a")
    assert table["sonicmoe"].startswith("n/a")  # a Hopper-only peer says why it sits out, on any other device
    dense, params = table["dense"]
    assert dense(x, idx, gates).shape == ref.shape
    # equal active FLOPs: as many weights as the (k + shared) experts a token passes through
    assert sum(p.numel() for p in params) == 3 * (cfg.top_k + shared) * cfg.intermediate * cfg.hidden


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
    assert result.read_text() == '{\n "a": 1\n}' and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "r.json"]
