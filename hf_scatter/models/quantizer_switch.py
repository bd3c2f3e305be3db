"""One entry of transformers' quantizer table pointed at our loader while it is switched on.

transformers picks a checkpoint's quantizer by its ``quant_method`` from one table (``AUTO_QUANTIZER_MAPPING``)
and offers no other way to keep a quantized checkpoint's bytes where its own quantizer would dequantize them.
A :class:`QuantizerSwitch` puts our entry in for one method and gives the stock one back, so a model loaded
outside hf-scatter's calls gets transformers' behaviour.
"""

from __future__ import annotations

import contextlib
from typing import Callable


class QuantizerSwitch:
    """``AUTO_QUANTIZER_MAPPING[method]`` as ``choose`` (called as the table's entries are, with the checkpoint's
    merged quantization config) while on."""

    def __init__(self, method: str, choose: Callable):
        self.method, self.choose = method, choose
        self._stock: list = []  # the table's own entry while ours is in place
        self.pinned = False  # switched on for the process (patch_transformers): a block's exit leaves it on

    @property
    def on(self) -> bool:
        return bool(self._stock)

    def enable(self, on: bool = True, pin: bool | None = None) -> None:
        """Our entry in (``on``) or the stock one back; ``pin``: whether a block's exit may switch it off."""
        from transformers.quantizers import auto

        if pin is not None:
            self.pinned = pin
        if on and not self._stock:
            self._stock.append(auto.AUTO_QUANTIZER_MAPPING[self.method])
            auto.AUTO_QUANTIZER_MAPPING[self.method] = self.choose
        elif not on and self._stock:
            auto.AUTO_QUANTIZER_MAPPING[self.method] = self._stock.pop()

    @contextlib.contextmanager
    def enabled(self):
        """On inside the block; as it was after it, unless it was pinned on meanwhile."""
        already = self.on
        self.enable(True)
        try:
            yield
        finally:
            if not already and not self.pinned:
                self.enable(False)
