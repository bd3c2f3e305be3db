"""When a request is finished: an end-of-sequence token, a stop string, or ``max_new_tokens``.

As in transformers, the token that ends a request is kept and what would follow it is padding.
"""

from __future__ import annotations

from typing import Sequence


class Stopping:
    def __init__(self, eos_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer=None):
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer to decode with: pass tokenizer=...")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {list(self.stop_strings)!r}")
        self.tokenizer = tokenizer
        # a stop string spans at most this many tokens (every token decodes to at least one character)
        self._window = max((len(s) for s in self.stop_strings), default=0) + 1

    def done(self, new_tokens: Sequence[int]) -> bool:
        """Whether the request whose generated tokens so far are ``new_tokens`` is finished."""
        if not new_tokens:
            return False
        if new_tokens[-1] in self.eos:
            return True
        if self.stop_strings:
            tail = self.tokenizer.decode(list(new_tokens[-self._window:]), skip_special_tokens=False)
            last = self.tokenizer.decode(list(new_tokens[-self._window:-1]), skip_special_tokens=False)
            # only a stop string that the last token completed (one seen earlier has already stopped it)
            return any(s in tail and s not in last for s in self.stop_strings)
        return False
