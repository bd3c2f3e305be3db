"""``Encoder``: serve a list of variable-length requests through the packed runtime, in request order.

    enc = hf_scatter.turbo.Encoder(model)                 # BertModel or a BERT head model, patched or not
    outs = enc.encode([[101, 2023, 102], [101, 7592, 2088, 102]])
    outs[0]["last_hidden_state"]  # [3, H]  (heads: outs[i]["logits"])

Requests are grouped by the batch scheduler (DP over a measured cost table, when one is given or cached
for this device and model; otherwise batches of at most ``max_batch`` requests / ``max_tokens`` tokens
in length order), packed on the host (no padding, no device sync) and run on the model's runtime: the
same plans and CUDA graphs the patched model's own forward uses.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch
from torch import nn

from .hf_forward import runtime_of
from .packing import PackedBatch, pack_sequences
from .scheduler import BatchScheduler, CostTable, cost_table_path, DEFAULT_BATCHES, DEFAULT_LENGTHS
from .unpadded import unsupported_architecture

_HEADS = ("BertForSequenceClassification", "BertForTokenClassification", "BertForMaskedLM")


def _bert_of(model: nn.Module) -> nn.Module:
    from transformers import BertModel

    if isinstance(model, BertModel):
        return model
    bert = getattr(model, "bert", None)
    if isinstance(bert, BertModel) and type(model).__name__ in _HEADS:
        return bert
    raise ValueError(f"Encoder: expected a BertModel or one of {', '.join(_HEADS)}, got {type(model).__name__}")


class Encoder:
    """Packed, scheduled inference for BERT-family models (see the module docstring).

    ``scheduler``: a :class:`BatchScheduler`; ``"auto"`` (default) loads the cost table cached for this
    device and model if :meth:`calibrate` saved one, else batches greedily by length. ``progress``: a
    progress bar over batches for long request lists.
    """

    def __init__(self, model: nn.Module, scheduler: BatchScheduler | str | None = "auto", max_batch: int = 64,
                 max_tokens: int = 16384, progress: bool = True, tokenizer=None):
        self.model = model
        self.bert = _bert_of(model)
        reason = unsupported_architecture(self.bert.config)
        if reason:
            raise ValueError(f"Encoder: this BERT cannot run packed: {reason}")
        if model.training:
            raise ValueError("Encoder: the model is in training mode (dropout); call model.eval() first")
        if max_batch < 1 or max_tokens < 1:
            raise ValueError("Encoder: max_batch and max_tokens must be >= 1")
        self.max_batch, self.max_tokens = max_batch, max_tokens
        self.progress = progress
        self.tokenizer = tokenizer
        self.runtime = runtime_of(self.bert)
        if scheduler == "auto":
            path = cost_table_path(self.cost_key())
            scheduler = BatchScheduler(CostTable.load(path), max_batch=max_batch, max_tokens=max_tokens) \
                if path.exists() else None
        elif scheduler is not None and not isinstance(scheduler, BatchScheduler):
            raise ValueError(f"Encoder: scheduler must be a BatchScheduler, 'auto' or None, got {scheduler!r}")
        self.scheduler = scheduler

    @property
    def device(self) -> torch.device:
        return self.runtime.params[0].device

    def cost_key(self) -> dict:
        """What a cost table depends on: device, model architecture and dtype."""
        config = self.bert.config.to_json_string(use_diff=False)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else f"{self.device.type}"
        return {"device": name, "model": hashlib.sha256(config.encode()).hexdigest()[:16],
                "dtype": str(self.runtime.params[0].dtype), "runtime": "packed"}

    # ---------------------------------------------------------------------------------------- batches
    def _ids(self, requests) -> list:
        if not isinstance(requests, (list, tuple)):
            raise ValueError(f"Encoder.encode: expected a list of requests, got {type(requests).__name__}")
        out = []
        for i, r in enumerate(requests):
            if isinstance(r, str):
                if self.tokenizer is None:
                    raise ValueError("Encoder.encode: got text; pass tokenizer= to Encoder, or token ids")
                r = self.tokenizer(r)["input_ids"]
            ids = r.tolist() if isinstance(r, torch.Tensor) else list(r)
            if not ids:
                raise ValueError(f"Encoder.encode: request {i} is empty")
            limit = self.bert.config.max_position_embeddings
            if len(ids) > limit:
                raise ValueError(f"Encoder.encode: request {i} has {len(ids)} tokens; the model takes at most {limit}")
            vocab = self.bert.embeddings.word_embeddings.num_embeddings
            low, high = min(ids), max(ids)
            if low < 0 or high >= vocab:  # caught here: on a GPU the embedding lookup would only assert
                raise ValueError(f"Encoder.encode: request {i} has token id {low if low < 0 else high}; the vocabulary "
                                 f"has {vocab} ids (0..{vocab - 1}): was it tokenized for another model?")
            out.append(ids)
        return out

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        """Request indices per batch."""
        if self.scheduler is not None:
            return self.scheduler.schedule(lengths)
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        groups, current, tokens = [], [], 0
        for i in order:
            if current and (len(current) == self.max_batch or tokens + lengths[i] > self.max_tokens):
                groups.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += lengths[i]
        return groups + ([current] if current else [])

    @torch.inference_mode()
    def run_batch(self, sequences: list, token_type_ids: list | None = None) -> list[dict[str, torch.Tensor]]:
        """One packed call for ``sequences`` (token-id lists); per-request outputs in their order."""
        if self.model.training:
            raise ValueError("Encoder: the model was put in training mode (dropout); call model.eval() first")
        batch = pack_sequences(sequences, "cpu", token_type_ids)  # the runtime stages it to the device
        hidden, pooled = self.runtime.run(batch)
        return self._outputs(batch, hidden[:batch.num_tokens], pooled)

    def _outputs(self, batch: PackedBatch, hidden: torch.Tensor, pooled) -> list[dict[str, torch.Tensor]]:
        name = type(self.model).__name__
        if name == "BertForSequenceClassification":
            logits = self.model.classifier(self.model.dropout(pooled))
            return [{"logits": row} for row in logits]
        if name == "BertForTokenClassification":
            return [{"logits": t} for t in batch.split(self.model.classifier(self.model.dropout(hidden)))]
        if name == "BertForMaskedLM":
            return [{"logits": t} for t in batch.split(self.model.cls(hidden))]
        hidden = hidden.clone()  # planned memory is reused by the next call
        pooled = None if pooled is None else pooled.clone()
        return [{"last_hidden_state": h, **({} if pooled is None else {"pooler_output": p})}
                for h, p in zip(batch.split(hidden), pooled if pooled is not None else [None] * batch.num_sequences)]

    def encode(self, requests, token_type_ids=None) -> list[dict[str, torch.Tensor]]:
        """Outputs for every request (token-id sequences, or strings with a tokenizer), in request order."""
        from tqdm.auto import tqdm

        ids = self._ids(requests)
        if token_type_ids is not None and len(token_type_ids) != len(ids):
            raise ValueError("Encoder.encode: token_type_ids needs one entry per request")
        results: list = [None] * len(ids)
        groups = self.batches([len(s) for s in ids])
        for group in tqdm(groups, desc="encoding", unit="batch", disable=not self.progress or len(groups) < 8):
            types = None if token_type_ids is None else [token_type_ids[i] for i in group]
            for i, out in zip(group, self.run_batch([ids[i] for i in group], types)):
                results[i] = out
        return results

    def warmup(self, max_tokens: int | None = None) -> float:
        """Plan and capture every length bucket a batch of this Encoder can need (up to ``max_tokens``,
        default the Encoder's), so no request pays for it later; returns the seconds it took."""
        return self.runtime.warmup(max_tokens or self.max_tokens, progress=self.progress)

    # ------------------------------------------------------------------------------------ calibration
    def calibrate(self, lengths=DEFAULT_LENGTHS, batches=DEFAULT_BATCHES, save: bool = True,
                  policy: str = "hungry", **scheduler_options) -> BatchScheduler:
        """Measure the cost table on this device (a few seconds on a GPU), save it for later Encoders of the
        same device and model, and use a DP scheduler from now on."""
        vocab = self.bert.config.vocab_size
        gen = torch.Generator().manual_seed(0)

        def run(length: int, batch: int) -> None:
            seqs = torch.randint(1000 if vocab > 2000 else 3, vocab, (batch, length), generator=gen)
            self.run_batch(list(seqs))

        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        table = CostTable.measure(run, lengths, batches, max_tokens=self.max_tokens, key=self.cost_key(), sync=sync,
                                  progress=self.progress)
        if save:
            table.save(cost_table_path(table.key))
        self.scheduler = BatchScheduler(table, policy=policy, max_batch=self.max_batch, max_tokens=self.max_tokens,
                                        **scheduler_options)
        return self.scheduler
