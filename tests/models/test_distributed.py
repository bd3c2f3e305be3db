"""Patched models inside the engines users train with, on CPU with gloo and 2 processes. Under PyTorch's FSDP2
(``fully_shard`` per decoder layer, then the root) and DeepSpeed ZeRO-3 (through accelerate, loaded already
partitioned, as Trainer does it) the losses and every parameter after 3 optimizer steps equal one process
training on the same global batch, and the full state dict the engine gathers is a vanilla checkpoint (same
names; a vanilla model loads it and gives the trained model's logits). transformers' expert parallelism
(experts split across the ranks) trains a model patched at construction to the one-process result. Patching
after sharding, CUDA-graph replay of sharded parameters and experts that the ranks cannot split evenly are
refused with an error or a warning that says what to do."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hf_scatter
from hf_scatter.bench.engines import expert_parallel_config
from hf_scatter.models.training_graphs import graphs_of
from hf_scatter.models.sharding import FSDP2, ZERO3, sharded_by
from hf_scatter.tiny import DECODER_FAMILIES, TINY_BUILDERS
from spawned_ranks import leave_rank

SIZES = dict(hidden=72, experts=6, top_k=3, intermediate=40)  # odd sizes; 6 experts: 3 per rank
WORLD, STEPS, ROWS, LENGTH = 2, 3, 4, 12


# what the engines do around the patched model is under test: see _engine_only_on_the_cpu
pytestmark = pytest.mark.kernel_bodies("reference")


def _engine_only_on_the_cpu(monkeypatch) -> None:
    """The kernels' torch reference inside the engines on the CPU (gloo): these tests are about what the engine
    does around the patched model (the same ops and autograd functions run, only their bodies differ; the
    kernels meet FSDP2's gathered parameters on the GPU, in the GPU tests below)."""
    monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
ENGINE_FAMILIES = ("mixtral", "qwen3_moe")  # each engine trains both in one pair of processes
ZERO3_FAMILIES = ("dbrx",) + DECODER_FAMILIES  # also loaded partitioned under ZeRO-3, at their tiny sizes
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32: the ranks' gradients are averaged in another order than one process sums them


def _model(family: str):
    torch.manual_seed(0)
    model = TINY_BUILDERS[family](**SIZES)
    model.config.use_cache = False
    return hf_scatter.patch_model(model.train())


def _batch() -> torch.Tensor:
    return torch.randint(3, 300, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))


def _train(model, rows: slice) -> list[float]:
    """SGD with momentum (AdamW's first steps are sign descent: rounding noise in a near-zero gradient would
    flip a whole learning-rate-sized update). Each step's loss is the mean over this process's rows."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ids = _batch()[rows]
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def _fsdp_worker(rank: int, init_file: str, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        found = {}
        for family in ENGINE_FAMILIES:  # one pair of processes for both: starting them is most of the cost
            model = _model(family)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            per_rank = ROWS // WORLD
            losses = torch.stack(_train(model, slice(rank * per_rank, (rank + 1) * per_rank)))
            dist.all_reduce(losses)  # equal token counts per rank: the mean of the ranks' means is the global mean
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            found[family] = {"losses": losses / WORLD, "state": state}
        found["misuse"] = _patch_after_fully_shard()
        if rank == 0:
            torch.save(found, out)
    finally:
        dist.destroy_process_group()
    leave_rank()


def _patch_after_fully_shard() -> dict:
    """A plain model sharded first, then patched and unpatched: what each call raised."""
    from torch.distributed.fsdp import fully_shard

    found = {}
    sharded = TINY_BUILDERS["mixtral"](**SIZES)
    found["before"] = sharded_by(sharded)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    found["after"] = sharded_by(sharded)
    for call in (hf_scatter.patch_model, hf_scatter.unpatch_model):
        try:
            call(sharded)
        except ValueError as error:
            found[call.__name__] = str(error)
    return found


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> dict:
    """One pair of FSDP2 processes (starting them is most of a test's cost) for the tests that read it."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    with pytest.MonkeyPatch.context() as monkeypatch:
        _engine_only_on_the_cpu(monkeypatch)
        mp.start_processes(_fsdp_worker, args=(str(tmp / "init"), str(tmp / "fsdp.pt")), nprocs=WORLD,
                           start_method="spawn", join=True)
    return torch.load(tmp / "fsdp.pt")


def test_fsdp2_training_equals_one_process_and_saves_a_vanilla_checkpoint(fsdp2_run):
    for family in ENGINE_FAMILIES:
        _assert_trained_like_one_process(family, fsdp2_run[family])


def test_patching_after_fully_shard_is_refused_with_the_order_to_use(fsdp2_run):
    found = fsdp2_run["misuse"]
    assert found["before"] is None and found["after"] == FSDP2
    for call in ("patch_model", "unpatch_model"):
        assert "patch it first, then shard it" in found[call], call


def _assert_trained_like_one_process(family: str, got: dict) -> None:
    """``got``'s mean losses and gathered full state dict equal one process training on the whole batch, and
    a vanilla transformers model loads that state dict and gives the trained model's logits."""
    single = _model(family)
    want_losses = torch.stack(_train(single, slice(None)))
    torch.testing.assert_close(got["losses"], want_losses, **TOL)
    want = single.state_dict()
    assert got["state"].keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got["state"][name], value, **TOL, msg=name)

    torch.manual_seed(0)
    vanilla = TINY_BUILDERS[family](**SIZES)
    vanilla.load_state_dict(got["state"])
    ids = _batch()
    with torch.no_grad():
        torch.testing.assert_close(vanilla.eval()(ids).logits, single.eval()(ids).logits, **TOL)


def _as_zero3_rank(rank: int, world: int, init_file: str) -> None:
    """This spawned process as a DeepSpeed rank on CPU: its environment, DeepSpeed's CPU accelerator, gloo."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import deepspeed.ops

    # DeepSpeed's shared-memory all-reduce for CPU would be compiled at start-up (half a minute): gloo does it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _zero3_config(rows: int) -> dict:
    return {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_gather_16bit_weights_on_model_save": True},
            # accelerate fills in a clip of 1.0 where the config names none; the one-process run has none
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True}


def _train_under_zero3(path: str, ids: torch.Tensor) -> dict:
    """ZeRO-3 the way Trainer runs it: with accelerate's DeepSpeed plugin in place, ``from_pretrained`` loads the
    checkpoint already partitioned (``zero.Init``), the partitioned model is patched, accelerate prepares it with
    :func:`_train`'s optimizer, and ``get_state_dict`` consolidates the parameters (Trainer's save path). Returns
    this rank's losses, the state dict (rank 0), the engine found at load and the patch report."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_zero3_config(ids.shape[0])))
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        partitioned = sharded_by(model)  # before the patch: ZeRO-3 partitioned the parameters at load
        model.config.use_cache = False
        model = hf_scatter.patch_model(model.train())
        engine, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        losses = []
        for _ in range(STEPS):
            loss = engine(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)  # accelerate's DeepSpeed wrapper also steps the engine here
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return {"losses": torch.stack(losses), "state": accelerator.get_state_dict(engine), "engine": partitioned,
                "report": hf_scatter.patch_report(model)}
    finally:
        unset_hf_deepspeed_config()  # the next model starts from a fresh plugin
        AcceleratorState._reset_state(True)


def _zero3_worker(rank: int, root: str, init_file: str, out: str) -> None:
    """Each family in turn, loaded partitioned over the two ranks, each rank training on its half of the rows:
    the engine families at the odd sizes (their state dicts kept), then every other family (losses only)."""
    _as_zero3_rank(rank, WORLD, init_file)
    try:
        per_rank = ROWS // WORLD
        ids = _batch()[rank * per_rank:(rank + 1) * per_rank]
        found = {}
        for kind, families in (("engine", ENGINE_FAMILIES), ("families", ZERO3_FAMILIES)):
            for family in families:
                got = _train_under_zero3(f"{root}/{kind}/{family}", ids)
                dist.all_reduce(got["losses"])  # equal token counts per rank: the mean of the ranks' means
                got["losses"] /= WORLD
                found[kind, family] = got if kind == "engine" else {k: got[k] for k in ("losses", "engine")}
        if rank == 0:
            torch.save(found, out)
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> tuple[dict, dict]:
    """One pair of ZeRO-3 processes for every family (starting them and DeepSpeed is most of a test's cost),
    and the one-process losses of the families trained for their losses only."""
    pytest.importorskip("deepspeed")
    tmp = tmp_path_factory.mktemp("zero3")
    want = {}
    for family in ENGINE_FAMILIES:
        torch.manual_seed(0)
        TINY_BUILDERS[family](**SIZES).save_pretrained(tmp / "engine" / family)  # the weights _model starts from
    for family in ZERO3_FAMILIES:
        torch.manual_seed(0)
        model = TINY_BUILDERS[family]()
        model.save_pretrained(tmp / "families" / family)
        model.config.use_cache = False
        with pytest.MonkeyPatch.context() as monkeypatch:
            _engine_only_on_the_cpu(monkeypatch)
            want[family] = torch.stack(_train(hf_scatter.patch_model(model.train()), slice(None)))
    with pytest.MonkeyPatch.context() as monkeypatch:
        _engine_only_on_the_cpu(monkeypatch)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # DeepSpeed's CPU accelerator, also on a GPU machine
        mp.start_processes(_zero3_worker, args=(str(tmp), str(tmp / "init"), str(tmp / "zero3.pt")), nprocs=WORLD,
                           start_method="spawn", join=True)
    return torch.load(tmp / "zero3.pt"), want


def test_deepspeed_zero3_training_equals_one_process_and_saves_a_vanilla_checkpoint(zero3_run):
    got, _ = zero3_run
    for family in ENGINE_FAMILIES:
        assert got["engine", family]["engine"] == ZERO3, family
        assert any(how.startswith("scattermoe") for how in got["engine", family]["report"].values()), family
        _assert_trained_like_one_process(family, got["engine", family])


def test_every_family_loaded_partitioned_by_zero3_trains_like_one_unpartitioned_process(zero3_run):
    """Patching reads modules, not parameter data: every family patched after ZeRO-3 partitioned it at load over
    two ranks trains 3 steps to the losses of the same patched model in one process without DeepSpeed (float32,
    1e-5). What is at stake is which parameters the patched forwards reach, not the kernels (the interpreter is
    tested elsewhere): both sides take the torch reference path."""
    got, want = zero3_run
    for family in ZERO3_FAMILIES:
        assert got["families", family]["engine"] == ZERO3, family
        torch.testing.assert_close(got["families", family]["losses"], want[family], **TOL, msg=family)


def test_graphs_over_parameters_partitioned_by_zero3_are_refused():
    """DeepSpeed ZeRO-3 marks each partitioned parameter with ``ds_id``: patching such a model with
    moe_graphs=True warns once and leaves the blocks eager (a graph replays fixed addresses)."""
    model = TINY_BUILDERS["mixtral"](**SIZES)
    for i, p in enumerate(model.parameters()):
        p.ds_id = i
    assert sharded_by(model) == "DeepSpeed ZeRO-3"
    with pytest.warns(RuntimeWarning, match="moe_graphs turned off: .*DeepSpeed ZeRO-3") as caught:
        hf_scatter.patch_model(model, moe_graphs=True)
    assert len([w for w in caught if "moe_graphs" in str(w.message)]) == 1
    assert not any(graphs_of(layer.mlp) for layer in model.model.layers)
    assert "router_topk" in hf_scatter.patch_report(model).values()  # the rest of the patch applies


def _graphs_then_shard_worker(rank: int, init_file: str, out: str) -> None:
    import warnings

    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        torch.manual_seed(0)
        model = hf_scatter.patch_model(TINY_BUILDERS["mixtral"](**SIZES).cuda().train(), moe_graphs=True)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        ids = _batch().cuda()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = []
            for _ in range(2):
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.item())
        graphs = graphs_of(model.model.layers[0].mlp)
        torch.save({"warnings": [str(w.message) for w in caught if "moe_graphs" in str(w.message)],
                    "captured": graphs.captured is not None, "losses": losses}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_graphs_of_a_model_sharded_after_patching_turn_off_with_one_warning(tmp_path):
    """patch_model(moe_graphs=True), then fully_shard: the first training step finds the sharding, says so
    once, and the blocks run eagerly (nothing captured over parameters FSDP2 gathers anew each pass)."""
    out = str(tmp_path / "found.pt")
    mp.start_processes(_graphs_then_shard_worker, args=(str(tmp_path / "init"), out), nprocs=1, start_method="spawn",
                       join=True)
    found = torch.load(out)
    assert len(found["warnings"]) == 1 and "FSDP2" in found["warnings"][0]
    assert not found["captured"] and all(loss == loss for loss in found["losses"])


def _library_under_fsdp2_worker(rank: int, init_file: str, out: str) -> None:
    """FSDP2 world size 1, a fine-grained shape at the library grouped GEMM's batch (1,024 rows per expert):
    peak memory and how often the library ran, with the library on and then off (HF_SCATTER_GROUPED_MM=0)."""
    import os

    import hf_scatter.moe.swiglu_experts as swiglu_experts
    from hf_scatter.bench.train import TrainConfig, build_model

    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=1)
    cfg = TrainConfig(hidden=1024, intermediate=512, experts=16, top_k=4, layers=4, heads=8, kv_heads=4, batch=2,
                      seq=2048)
    calls, library_rows = [], swiglu_experts.grouped_mm_rows

    def counted(*args, **kwargs):
        calls.append(1)
        return library_rows(*args, **kwargs)

    swiglu_experts.grouped_mm_rows = counted
    found = {}
    try:
        for switch in ("", "0"):
            os.environ["HF_SCATTER_GROUPED_MM"] = switch
            model = build_model("qwen3_moe-hf-scatter", cfg, torch.device("cuda"), torch.bfloat16, fsdp=True)
            ids = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), device="cuda")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            for step in range(3):
                if step == 1:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    calls.clear()
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            found[switch or "on"] = {"peak": torch.cuda.max_memory_allocated(), "library_calls": len(calls)}
            del model, opt
            torch.cuda.empty_cache()
        torch.save(found, out)
    finally:
        swiglu_experts.grouped_mm_rows = library_rows
        os.environ.pop("HF_SCATTER_GROUPED_MM", None)
        dist.destroy_process_group()


@pytest.mark.gpu
def test_library_grouped_gemm_under_fsdp2_holds_no_extra_weight_copy(tmp_path):
    """Under FSDP2 (world size 1) the library grouped GEMM path keeps the peak of the path without it (within
    2%): gathered expert weights are neither copied nor kept alive past their layer."""
    out = str(tmp_path / "found.pt")
    mp.start_processes(_library_under_fsdp2_worker, args=(str(tmp_path / "init"), out), nprocs=1,
                       start_method="spawn", join=True)
    found = torch.load(out)
    assert found["on"]["library_calls"] > 0, "the shape must take the library path, or nothing is tested"
    assert found["0"]["library_calls"] == 0
    assert found["on"]["peak"] <= 1.02 * found["0"]["peak"], found


def _expert_parallel_worker(rank: int, root: str, init_file: str, out: str) -> None:
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))  # what transformers reads
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        config, shared_batch = expert_parallel_config(WORLD)  # what bench train's ep engine builds
        found = {}
        for family in ENGINE_FAMILIES:  # one pair of processes for both
            model = _expert_parallel_model(f"{root}/{family}", config)
            model.config.use_cache = False
            experts = model.model.layers[0].mlp.experts
            per_rank = ROWS // WORLD
            rows = slice(None) if shared_batch else slice(rank * per_rank, (rank + 1) * per_rank)
            losses = torch.stack(_train(model.train(), rows))
            dist.all_reduce(losses)
            found[family] = {"losses": losses / WORLD, "report": hf_scatter.patch_report(model),
                             "num_local": experts.num_experts,
                             "local": {name: p.to_local().detach().clone() for name, p in experts.named_parameters()}}
        try:  # 5 experts over 2 ranks
            _expert_parallel_model(f"{root}/qwen3_moe-5-experts", config)
            found["uneven"] = None
        except Exception as error:  # noqa: BLE001 - the test reads which error, and what it says
            found["uneven"] = f"{type(error).__name__}: {error}"
        torch.save(found, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    leave_rank()


def _expert_parallel_model(path: str, config):
    from transformers import AutoModelForCausalLM

    hf_scatter.patch_transformers()
    try:
        return AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32)
    finally:
        hf_scatter.unpatch_transformers()


@pytest.fixture(scope="module")
def expert_parallel_run(tmp_path_factory) -> tuple:
    """One pair of expert-parallel processes for the tests that read it: (checkpoints folder, each rank's
    results)."""
    tmp = tmp_path_factory.mktemp("ep")
    for family in ENGINE_FAMILIES:
        torch.manual_seed(0)
        TINY_BUILDERS[family](**SIZES).save_pretrained(tmp / family)
    TINY_BUILDERS["qwen3_moe"](**dict(SIZES, experts=5)).save_pretrained(tmp / "qwen3_moe-5-experts")
    with pytest.MonkeyPatch.context() as monkeypatch:
        _engine_only_on_the_cpu(monkeypatch)
        # On CPU with gloo: transformers would place each rank on its own GPU where one is visible.
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        out = str(tmp / "ep.pt")
        mp.start_processes(_expert_parallel_worker, args=(str(tmp), str(tmp / "init"), out),
                           nprocs=WORLD, start_method="spawn", join=True)
    return tmp, [torch.load(f"{out}.{rank}") for rank in range(WORLD)]


def test_expert_parallel_training_equals_one_process(expert_parallel_run):
    from transformers import AutoModelForCausalLM

    root, got = expert_parallel_run
    for family in ENGINE_FAMILIES:
        single = hf_scatter.patch_model(AutoModelForCausalLM.from_pretrained(root / family, dtype=torch.float32))
        single.config.use_cache = False
        want_losses = torch.stack(_train(single.train(), slice(None)))
        experts = single.model.layers[0].mlp.experts
        local = SIZES["experts"] // WORLD
        for rank, found in enumerate(got):
            result = found[family]
            assert result["num_local"] == local, family
            assert result["report"]["model.layers.0.mlp.experts"].startswith("scattermoe"), family
            torch.testing.assert_close(result["losses"], want_losses, **TOL, msg=family)
            for name, value in result["local"].items():  # this rank's experts after 3 steps: the same weights
                torch.testing.assert_close(value, getattr(experts, name)[rank * local:(rank + 1) * local].detach(),
                                           **TOL, msg=f"{family}, rank {rank}: {name}")


def test_expert_parallel_over_ranks_that_do_not_divide_the_experts_is_refused(expert_parallel_run):
    """5 experts over 2 ranks: construction stops with transformers' error naming both numbers, on every rank,
    before any step (the patch adds nothing that would hide it)."""
    for rank, found in enumerate(expert_parallel_run[1]):
        assert found["uneven"] is not None and "5 experts across 2" in found["uneven"], (rank, found["uneven"])
