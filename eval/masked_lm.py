"""Masked-LM pseudo-log-likelihood scoring, so BERT-family encoders get the same parity check.

lm-eval scores text with a causal language model; an encoder has no such probability. The standard
substitute is the pseudo-log-likelihood (Salazar et al., 2020, "Masked Language Model Scoring"): mask one
token at a time and sum log P(token | every other token). Here a continuation's score masks only its own
tokens, with the context (and the rest of the continuation) visible, which gives multiple-choice accuracy
and rolling pseudo-perplexity. Encoders cannot generate, so ``generate_until`` tasks are refused.

The same scorer runs vanilla and patched, so the parity check compares like with like.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm


class MaskedLMCannotGenerate(NotImplementedError):
    pass


def load_masked_lm(pretrained: str, dtype: str | torch.dtype = "auto", device: str = "cpu"):
    from transformers import AutoModelForMaskedLM

    return AutoModelForMaskedLM.from_pretrained(pretrained, dtype=dtype).to(device).eval()


@register_model("hf-scatter-mlm")
class MaskedLMScorer(TemplateLM):
    """Pseudo-log-likelihood scores from a masked LM; ``patch=True`` (default) runs it on hf-scatter.

    ``model_args``: ``pretrained`` (a directory or a loaded ``*ForMaskedLM`` model), ``tokenizer`` (a
    directory or tokenizer; default: ``pretrained``'s), ``dtype``, ``device``, ``batch_size`` (masked copies
    per forward), ``max_length``, ``patch``, ``scoring_dtype`` (of the log-probabilities and their sums).
    """

    def __init__(self, pretrained, tokenizer=None, dtype: str | torch.dtype = "auto", device: str = "cpu",
                 batch_size: int | str = 32, max_length: int | None = None, patch: bool = True,
                 scoring_dtype: str | torch.dtype = "float32", **unused):
        super().__init__()
        from transformers import AutoTokenizer

        if unused:
            raise TypeError(f"hf-scatter-mlm: unknown model_args {', '.join(sorted(unused))}")
        model = load_masked_lm(pretrained, dtype, device) if isinstance(pretrained, str) else pretrained
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or pretrained)
        if tokenizer.mask_token_id is None:
            raise ValueError("hf-scatter-mlm: the tokenizer has no mask token, which pseudo-log-likelihood scoring "
                             "needs; use the tokenizer the masked LM was trained with")
        import hf_scatter

        if patch:
            hf_scatter.patch_model(model)
        self.patch_report = hf_scatter.patch_report(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self._device = next(model.parameters()).device
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 32
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", 512)
        self._prefix = [tokenizer.cls_token_id] if tokenizer.cls_token_id is not None else []
        self._suffix = [tokenizer.sep_token_id] if tokenizer.sep_token_id is not None else []
        self._pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.scoring_dtype = getattr(torch, scoring_dtype) if isinstance(scoring_dtype, str) else scoring_dtype

    @property
    def device(self):
        return self._device

    @property
    def eot_token_id(self) -> int:
        for token in (self.tokenizer.sep_token_id, self.tokenizer.eos_token_id, self.tokenizer.cls_token_id):
            if token is not None:
                return token
        raise ValueError("hf-scatter-mlm: the tokenizer has no SEP, EOS or CLS token to stand for an empty context")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=False)["input_ids"]

    def _room(self) -> int:
        return self.max_length - len(self._prefix) - len(self._suffix)

    def _score(self, jobs: list[tuple[list[int], int, int]], desc: str, disable: bool) -> list[tuple[float, bool]]:
        """``jobs``: (token ids, first scored position, end): masks each scored position once; returns the
        summed log-probability and whether every scored token was the top prediction."""
        rows = [(j, pos) for j, (_, start, end) in enumerate(jobs) for pos in range(start, end)]
        totals = [0.0] * len(jobs)
        greedy = [True] * len(jobs)
        mask_id = self.tokenizer.mask_token_id
        for b in tqdm(range(0, len(rows), self.batch_size), desc=desc, disable=disable or not rows):
            batch = rows[b:b + self.batch_size]
            seqs = [self._prefix + jobs[j][0] + self._suffix for j, _ in batch]
            width = max(map(len, seqs))
            ids = torch.full((len(batch), width), self._pad, dtype=torch.long)
            attention = torch.zeros((len(batch), width), dtype=torch.long)
            for r, seq in enumerate(seqs):
                ids[r, :len(seq)] = torch.tensor(seq)
                attention[r, :len(seq)] = 1
            where = torch.tensor([len(self._prefix) + pos for _, pos in batch])
            rows_idx = torch.arange(len(batch))
            truth = ids[rows_idx, where].clone()
            ids[rows_idx, where] = mask_id
            with torch.no_grad():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device)).logits
            logprobs = torch.log_softmax(logits[rows_idx.to(self.device), where.to(self.device)].to(self.scoring_dtype),
                                         dim=-1)
            picked = logprobs.gather(1, truth.to(self.device)[:, None])[:, 0].tolist()
            top = (logprobs.argmax(-1).cpu() == truth).tolist()
            for (j, _), lp, is_top in zip(batch, picked, top):
                totals[j] += lp
                greedy[j] = greedy[j] and is_top
        return list(zip(totals, greedy))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        jobs = []
        for _, context, continuation in requests:
            if len(continuation) > self._room():
                raise ValueError(f"hf-scatter-mlm: a continuation of {len(continuation)} tokens does not fit the "
                                 f"model's {self.max_length} positions")
            tokens = (context + continuation)[-self._room():]  # keep the continuation, trim the context's start
            jobs.append((tokens, len(tokens) - len(continuation), len(tokens)))
        return self._score(jobs, "Masked-LM loglikelihood", disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Pseudo-log-likelihood of each whole text, in disjoint windows of the model's length."""
        jobs, owner = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for start in range(0, len(tokens), self._room()):
                window = tokens[start:start + self._room()]
                jobs.append((window, 0, len(window)))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (score, _) in zip(owner, self._score(jobs, "Masked-LM rolling loglikelihood", disable_tqdm)):
            totals[i] += score
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise MaskedLMCannotGenerate("hf-scatter-mlm: a masked LM (encoder) cannot generate text; leave "
                                     "generate_until tasks (e.g. hfs_generation) out for BERT-family models")
