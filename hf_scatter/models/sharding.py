"""Which distributed engine, if any, shards a model's parameters: what patching and graph capture must know.

FSDP2's ``fully_shard`` turns each wrapped module into a subclass of its own class and gathers the
parameters into fresh memory for every forward and backward; DeepSpeed ZeRO-3 partitions parameters in
place (marking each with ``ds_id``) and gathers them through hooks. The kernels see gathered parameters
under both, but a class swap after ``fully_shard`` and a CUDA graph's fixed addresses cannot work.
"""

from __future__ import annotations

from torch import nn

FSDP2 = "FSDP2 (fully_shard)"
ZERO3 = "DeepSpeed ZeRO-3"


def sharded_by(model: nn.Module) -> str | None:
    """:data:`FSDP2`, :data:`ZERO3` or None for ``model`` (any of its modules wrapped or partitioned)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        FSDPModule = None
    for module in model.modules():
        if FSDPModule is not None and isinstance(module, FSDPModule):
            return FSDP2
        if any(hasattr(p, "ds_id") for p in module.parameters(recurse=False)):
            return ZERO3
    return None
