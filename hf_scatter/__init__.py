"""hf-scatter: Mixture-of-Experts and BERT models on fused Triton kernels, behind one call.

Importing registers ``"scattermoe"`` with transformers' experts interface, so
``from_pretrained(path, experts_implementation="scattermoe")`` works without any other call. The kernels
themselves load on first use.
"""

from __future__ import annotations

__version__ = "0.1.0"

_PUBLIC = {"check_supported", "from_pretrained", "load_as_shipped", "patch_model", "patch_report",
           "patch_transformers", "supported_model_types", "unpatch_model", "unpatch_transformers"}


def __getattr__(name: str):
    if name in ("offload", "offload_model"):  # the subpackage, or its function offload_model(model, gpu_memory=...)
        import importlib

        package = importlib.import_module(".offload", __name__)
        return package if name == "offload" else package.offload_model
    if name in _PUBLIC:
        from . import patching

        return getattr(patching, name)
    raise AttributeError(f"module 'hf_scatter' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _PUBLIC | {"offload", "offload_model"})


from .kernels.backend import interpret_if_asked as _interpret_if_asked  # noqa: E402

_interpret_if_asked()  # HF_SCATTER_KERNELS=triton without a GPU: before transformers imports Triton

from .models.experts import SCATTERMOE  # noqa: E402
from .models.experts import register_experts_backend as _register_experts_backend  # noqa: E402

_register_experts_backend()

__all__ = ["SCATTERMOE", "__version__", "offload", "offload_model", *sorted(_PUBLIC)]
