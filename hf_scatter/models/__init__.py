"""Model families hf-scatter patches, one module each, behind one registry (:mod:`.registry`).

Light to import: the family modules (and their transformers modeling code) load on first use of
:func:`families`.
"""

from .experts import SCATTERMOE, is_interface_experts, patch_interface_experts, register_experts_backend
from .registry import Family, PatchOptions, families

__all__ = ["Family", "PatchOptions", "SCATTERMOE", "families", "is_interface_experts", "patch_interface_experts",
           "register_experts_backend"]
