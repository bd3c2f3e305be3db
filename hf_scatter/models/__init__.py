"""One adapter per model family (keyed by ``config.model_type``); importing this package registers them."""

from . import bert, dbrx, mixtral  # noqa: F401  (registration)
from .experts import SCATTERMOE
from .mixtral import is_interface_experts, patch_interface_experts
from .registry import FAMILIES, Family, PatchOptions

__all__ = ["FAMILIES", "Family", "PatchOptions", "SCATTERMOE", "is_interface_experts", "patch_interface_experts"]
