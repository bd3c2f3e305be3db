"""Next-token choice from fp32 logits: greedy, or sampling with temperature, top-k and top-p, seeded; before
it, optionally, transformers' own repetition penalty, n-gram block and ``min_new_tokens`` processors.

The logits processors apply in the order transformers applies them (repetition penalty, no-repeat n-grams,
min_new_tokens, then temperature, top-k, top-p), so the same settings mean the same distribution. Sampling
draws from one generator on the device, seeded once per ``generate`` call: the same seed, requests and policy
give the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    eos_token_ids: tuple[int, ...] = ()  # what min_new_tokens holds back
    _processors: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # by device

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (use do_sample=False for greedy)")
        if self.top_k is not None and (int(self.top_k) != self.top_k or self.top_k < 0):
            raise ValueError(f"top_k must be a non-negative integer (0 or None: off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("min_new_tokens", "no_repeat_ngram_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer (0: off), got {value!r}")
        penalty = self.repetition_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not (math.isfinite(penalty)
                                                                                     and penalty > 0):
            raise ValueError(f"repetition_penalty must be a positive number (1.0: off; above 1 discourages "
                             f"repeats), got {penalty!r}")

    @property
    def uses_history(self) -> bool:
        """Whether a processor reads the tokens each row has seen: only then does the pipeline keep them."""
        return (self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0
                or (self.min_new_tokens > 0 and bool(self.eos_token_ids)))

    def generator(self, device: torch.device) -> torch.Generator | None:
        if not self.do_sample:
            return None
        seed = self.seed if self.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        return torch.Generator(device=device).manual_seed(seed)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None,
               history: "History | None" = None) -> torch.Tensor:
        """[rows, vocab] fp32 logits -> [rows] token ids (``history``: those rows' tokens, if
        :attr:`uses_history`)."""
        if history is not None:
            logits = self._process(logits, history)
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

    def _process(self, logits: torch.Tensor, history: "History") -> torch.Tensor:
        """transformers' processors, in ``generate``'s order, built once per device (the EOS tensor lives there)."""
        built = self._processors.get(logits.device)
        if built is None:
            from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                                NoRepeatNGramLogitsProcessor,
                                                                RepetitionPenaltyLogitsProcessor)

            built = self._processors[logits.device] = (
                RepetitionPenaltyLogitsProcessor(float(self.repetition_penalty))
                if self.repetition_penalty != 1.0 else None,
                NoRepeatNGramLogitsProcessor(self.no_repeat_ngram_size) if self.no_repeat_ngram_size else None,
                # counts what it is given as new tokens: the generated columns only
                MinNewTokensLengthLogitsProcessor(0, self.min_new_tokens, list(self.eos_token_ids), logits.device)
                if self.min_new_tokens and self.eos_token_ids else None)
        penalty, ngrams, min_new = built
        if penalty is not None:
            logits = penalty(history.tokens, logits)
        if ngrams is not None:
            logits = ngrams(history.unpadded(logits.shape[-1]), logits)
        if min_new is not None and history.new < self.min_new_tokens:
            logits = min_new(history.tokens[:, history.width:], logits)
        return logits


class History:
    """Each row's prompt and the tokens generated so far, on the device, as the processors read them: prompts
    end at column ``width`` and generated token k sits at ``width + k``. A shorter prompt is preceded by copies
    of its own first token: a repetition penalty counts a token once, so they change nothing, and the n-gram
    block sees them masked (:meth:`unpadded`). A row's tokens are its own, padding never included."""

    def __init__(self, tokens: torch.Tensor, starts: torch.Tensor, width: int, new: int):
        self.tokens, self.starts, self.width, self.new = tokens, starts, width, new

    @classmethod
    def of(cls, prompts: list[torch.Tensor], max_new_tokens: int, device: torch.device) -> "History":
        width = max(len(p) for p in prompts)
        tokens = torch.empty(len(prompts), width + max_new_tokens, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, :width - len(p)] = p[0]
            tokens[i, width - len(p):width] = p
        starts = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
        return cls(tokens.to(device), starts.to(device), width, 0)

    def view(self, rows, new: int | None = None) -> "History":
        """These rows (a slice or index tensor), up to ``new`` generated tokens (default: as many as here)."""
        new = self.new if new is None else new
        return History(self.tokens[rows, :self.width + new], self.starts[rows], self.width, new)

    def record(self, rows, new: int, tokens: torch.Tensor) -> None:
        """Generated token number ``new`` of these rows."""
        self.tokens[rows, self.width + new] = tokens

    def unpadded(self, vocab: int) -> torch.Tensor:
        """The tokens with each row's padding replaced by ``vocab`` (no real token): no n-gram matches it."""
        columns = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return self.tokens.masked_fill(columns < self.starts[:, None], vocab)
