"""The engines ``bench train`` runs a model under, set up as their users set them up, and the ranks' numbers.

Nothing here distributes anything itself: PyTorch FSDP2 (``fully_shard`` per decoder layer, then the root),
transformers' expert parallelism (``DistributedConfig`` at ``from_pretrained``) and DeepSpeed ZeRO-3 (through
accelerate, the model partitioned as it is built) do. One process group serves every variant of a run; each
rank measures its own steps, and rank 0 gathers them (``all_gather_object``) and sums them up per variant.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..common.intervals import length, overlap, union

ENGINES = ("none", "fsdp2", "ep", "zero3")
NOT_MEASURED = "not measured"


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def world_size() -> int:
    """The processes of this run: the process group's, else torchrun's, else 1."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


@contextlib.contextmanager
def process_group(on: bool, device: str = "cuda") -> Iterator[None]:
    """The group every variant of a run shares. Under torchrun: all its processes, NCCL on CUDA with each rank on
    GPU ``LOCAL_RANK``, gloo on the CPU. Elsewhere, where ``on``: one process over a file store (FSDP2 at world
    size 1). Nothing where the caller made a group already (a test, a script)."""
    if dist.is_initialized() or not (on or under_torchrun()):
        yield
        return
    cuda = device == "cuda"
    if under_torchrun():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        try:
            yield
        finally:
            dist.destroy_process_group()
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # the group's file store lives as long as the group
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@dataclasses.dataclass(frozen=True)
class Fsdp2Options:
    """The FSDP2 knobs the overlap work turns: resharding after forward (``fully_shard``'s default, and
    torchtitan's without pipeline parallelism, is True), the gradient reduce-scatter's dtype, and explicit
    prefetch: ``"next"`` has each decoder layer gather the next one's parameters in forward and the previous
    one's in backward (torchtitan's schedule), ``"none"`` leaves FSDP2's implicit prefetch."""

    reshard_after_forward: bool = True
    reduce_dtype: str = "float32"
    prefetch: str = "none"


@dataclasses.dataclass(frozen=True)
class Setup:
    """The engine every variant of a run trains under, at the run's world size."""

    engine: str = "none"
    world: int = 1
    fsdp2: Fsdp2Options = Fsdp2Options()

    @property
    def shared_batch(self) -> bool:
        """Expert parallelism on transformers releases without ``ep_size`` runs on the tensor-parallel group,
        whose ranks share one batch: its tokens count once, not once per rank."""
        return self.engine == "ep" and expert_parallel_config(self.world)[1]

    def describe(self, rows: int, cuda: bool) -> dict:
        """What the report records of the engine: its name, world size and settings."""
        found = {"engine": self.engine, "world": self.world, "shared_batch": self.shared_batch}
        if self.engine == "fsdp2":
            found["fsdp2"] = dataclasses.asdict(self.fsdp2)
        elif self.engine == "ep":
            found["distributed_config"] = expert_parallel_config(self.world, bf16=cuda)[0].to_dict()
        elif self.engine == "zero3":
            found["deepspeed_config"] = zero3_config(rows, bf16=cuda)
        return found


def fully_shard_layers(model, param_dtype: torch.dtype, options: Fsdp2Options = Fsdp2Options()) -> None:
    """FSDP2 as the docs recommend it: ``fully_shard`` each decoder layer, then the root (embeddings, final
    norm, LM head), with ``param_dtype`` parameters in compute. Call after patching."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reduce_dtype = getattr(torch, options.reduce_dtype)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    base = model.base_model
    layers = list(getattr(base, "layers", None) or base.blocks)  # DBRX: transformer.blocks
    for layer in layers:
        _shard_kept_in_float32(layer, reduce_dtype, options.reshard_after_forward)
        fully_shard(layer, mp_policy=policy, reshard_after_forward=options.reshard_after_forward)
    _shard_kept_in_float32(model, reduce_dtype, True)
    fully_shard(model, mp_policy=policy)  # the root keeps its parameters for backward whatever the setting
    if options.prefetch == "next":
        for layer, following in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([layer])


def _shard_kept_in_float32(root: torch.nn.Module, reduce_dtype: torch.dtype, reshard_after_forward: bool) -> None:
    """Modules a bf16 model keeps in float32 (transformers' ``_keep_in_fp32_modules``: DeepSeek-V2's router
    weight) get an FSDP2 group of their own that computes in float32: one group must hold one dtype, and the
    family computes in float32 there on purpose."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    dtypes = {p.dtype for p in root.parameters()}
    if len(dtypes) < 2 or torch.float32 not in dtypes:
        return
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype)
    # modules already in a group (fully_shard replaces their parameters, so track modules, not parameters)
    taken = {m for group in root.modules() if isinstance(group, FSDPModule) for m in group.modules()}
    for module in root.modules():  # parents first: a float32 module takes its float32 children along
        if module is root or module in taken or not list(module.parameters(recurse=False)):
            continue
        if all(p.dtype == torch.float32 for p in module.parameters()):
            fully_shard(module, mp_policy=policy, reshard_after_forward=reshard_after_forward)
            taken.update(module.modules())


def expert_parallel_config(world: int, bf16: bool = False):
    """(transformers' ``DistributedConfig`` splitting the experts over ``world`` ranks, whether the ranks share
    one batch). Releases with ``ep_size`` run FSDP2 over the same ranks, each rank on its own rows, the tokens
    exchanged all-to-all; with ``bf16``, FSDP2's mixed precision (bf16 compute, float32 gradient reduction, as
    the fsdp2 engine's default). Earlier 5.x releases take ``enable_expert_parallel`` on the tensor-parallel
    group, whose ranks share one batch."""
    from transformers.distributed import DistributedConfig

    if "ep_size" in {f.name for f in dataclasses.fields(DistributedConfig)}:
        return DistributedConfig(ep_size=world, fsdp_size=world, fsdp_mixed_precision=bf16), False
    return DistributedConfig(enable_expert_parallel=True, tp_size=world, fsdp_size=1), True


def _by_tensor_kind(params) -> list[dict]:
    """Parameter groups of plain tensors and of DTensors apart: transformers 5.17's expert parallelism leaves the
    experts as DTensors beside plain ones, and a fused optimizer step takes one kind at a time."""
    from torch.distributed.tensor import DTensor

    groups: dict[bool, list] = {}
    for p in params:
        groups.setdefault(isinstance(p, DTensor), []).append(p)
    return [{"params": found} for found in groups.values()]


def zero3_config(rows: int, bf16: bool) -> dict:
    """DeepSpeed ZeRO-3 with its defaults, bf16 (fp32 master weights and optimizer states, partitioned) on the
    GPU. No gradient clipping (accelerate fills in 1.0 where the config names none; the other engines clip
    nothing); torch's AdamW, which the other engines step too, is an optimizer DeepSpeed calls untested."""
    return {"train_micro_batch_size_per_gpu": rows, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3}, "bf16": {"enabled": bf16}, "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True}


def adamw_step(model, ids: torch.Tensor) -> tuple[Callable[[], torch.Tensor], torch.optim.Optimizer]:
    """One training step on ``ids`` (AdamW, fused on the GPU) and its optimizer."""
    opt = torch.optim.AdamW(_by_tensor_kind(model.parameters()), lr=1e-4, fused=ids.is_cuda)

    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, opt


@contextlib.contextmanager
def trained(setup: Setup, build: Callable[..., torch.nn.Module], ids: torch.Tensor,
            param_dtype: torch.dtype) -> Iterator[tuple[torch.nn.Module, Callable[[], torch.Tensor]]]:
    """The model ``build(distributed_config=None)`` makes (patched already), under ``setup.engine``, with one
    AdamW training step on ``ids``; the engine's state is let go on exit, so the next variant starts clean."""
    if setup.engine == "zero3":
        with _zero3_step(build, ids) as found:
            yield found
        return
    ep = setup.engine == "ep"
    model = build(distributed_config=expert_parallel_config(setup.world, bf16=ids.is_cuda)[0] if ep else None)
    if setup.engine == "fsdp2":
        fully_shard_layers(model, param_dtype, setup.fsdp2)
    step, opt = adamw_step(model, ids)
    yield model, step


@contextlib.contextmanager
def _zero3_step(build, ids: torch.Tensor):
    """ZeRO-3 as Trainer runs it: with accelerate's DeepSpeed plugin in place the model is partitioned as it is
    built (``zero.Init``), then patched, then prepared with the optimizer; ``accelerator.backward`` also steps
    DeepSpeed's engine."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    bf16 = ids.is_cuda
    plugin = DeepSpeedPlugin(hf_ds_config=zero3_config(ids.shape[0], bf16))
    accelerator = Accelerator(mixed_precision="bf16" if bf16 else "no", deepspeed_plugin=plugin)
    engine = None
    try:
        model = build(distributed_config=None)
        engine, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step() -> torch.Tensor:
            loss = engine(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        yield engine, step
    finally:
        if engine is not None:
            engine.destroy()
        accelerator.free_memory()
        unset_hf_deepspeed_config()  # the next model starts from a fresh plugin
        AcceleratorState._reset_state(True)


def gather(found: dict) -> list[dict]:
    """Every rank's ``found``, in rank order (each rank gets the list; rank 0 reports it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [found]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    return everyone


_COMM_KEYS = ("nccl_ms", "compute_ms", "exposed_comm_ms")


def aggregate(ranks: list[dict]) -> dict:
    """One variant over its ranks: tokens/s and model TFLOP/s per GPU are the ranks' means (each rank's count
    its own tokens, a shared batch's once, split over the ranks), the step time, the host's time to issue it,
    peak memory and communication the largest rank's, the first-step loss the mean of the ranks' (each over as
    many tokens) with every rank's raw numbers kept under ``ranks``."""
    def largest(key: str):
        values = [r.get(key) for r in ranks]
        return None if any(v is None for v in values) else max(values)

    comm = [r["comm_ms"] for r in ranks]
    return {"tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in ranks),
            "tokens_per_s_all_gpus": sum(r["tokens_per_s"] for r in ranks),
            "tflops_per_gpu": statistics.fmean(r["tflops"] for r in ranks),
            "model_flops_per_step": sum(r["model_flops"] for r in ranks),
            "step_ms_median": largest("step_ms_median"), "step_ms_all": ranks[0]["step_ms_all"],
            "host_issue_ms_median": largest("host_issue_ms_median"),
            "peak_gib": largest("peak_gib"), "peak_reserved_gib": largest("peak_reserved_gib"),
            "first_step_loss": statistics.fmean(r["first_step_loss"] for r in ranks),
            "comm_ms": NOT_MEASURED if any(isinstance(c, str) for c in comm) else
            {k: max(c[k] for c in comm) for k in _COMM_KEYS},
            "ranks": ranks}


def comm_split(kernels: list[tuple[str, float, float]], steps: int) -> dict | str:
    """GPU time per step (ms) of the NCCL kernels (name with "nccl"), of every other kernel, and of the
    communication no other kernel overlaps, from (name, start us, end us) of the GPU's kernels over ``steps``
    steps: each as the union of its intervals, so kernels on several streams count once."""
    if not kernels:
        return NOT_MEASURED
    comm = union([(a, b) for name, a, b in kernels if "nccl" in name.lower()])
    compute = union([(a, b) for name, a, b in kernels if "nccl" not in name.lower()])
    return {"nccl_ms": length(comm) / steps / 1e3, "compute_ms": length(compute) / steps / 1e3,
            "exposed_comm_ms": (length(comm) - overlap(comm, compute)) / steps / 1e3}


def profile_comm(step: Callable[[], torch.Tensor], cuda: bool, steps: int = 2) -> dict | str:
    """:func:`comm_split` of ``steps`` steps under ``torch.profiler``. On the CPU (gloo) there are no GPU
    kernels to read: "not measured", without running the steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        return NOT_MEASURED
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == DeviceType.CUDA]
    return comm_split(kernels, steps)
