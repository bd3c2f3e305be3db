"""Checkpoint converter, HF <-> hf-scatter layout (``hf-scatter convert``; docs/conversion.md).

Installed as ``hf_scatter.conversion``. Streams one tensor at a time, checks the whole input before
writing, and renames its output into place only when complete.
"""

from .writer import ConversionResult, convert
from .layout import CONFIG_KEY, FORMAT_VERSION
from .plan import TO_HF, TO_SCATTER, Plan, build_plan
from .safetensors_io import ConversionError

__all__ = ["CONFIG_KEY", "FORMAT_VERSION", "TO_HF", "TO_SCATTER", "ConversionError", "ConversionResult", "Plan",
           "build_plan", "convert"]
