"""Next-token choice from fp32 logits: greedy, or sampling with temperature, top-k and top-p, seeded.

The logits processors apply in the order transformers applies them (temperature, then top-k, then
top-p), so the same settings mean the same distribution. Sampling draws from one generator on the
device, seeded once per ``generate`` call: the same seed, requests and policy give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (use do_sample=False for greedy)")
        if self.top_k is not None and (int(self.top_k) != self.top_k or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative integer (0 or None: off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def generator(self, device: torch.device) -> torch.Generator | None:
        if not self.do_sample:
            return None
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        return torch.Generator(device=device).manual_seed(seed)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """[rows, vocab] fp32 logits -> [rows] token ids."""
        if not self.do_sample:
            return logits.argmax(dim=-1)
        scores = logits / self.temperature if self.temperature != 1.0 else logits
        if self.top_k:
            k = min(int(self.top_k), scores.shape[-1])
            kth = torch.topk(scores, k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            # drop a token once the ones before it already reach top_p (the most likely always stays)
            drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= self.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, float("-inf"))
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
