"""What one decoder layer of a model costs: FLOPs and bytes of each op, weight and KV-cache sizes.

The performance model needs only shapes, so a model is described by its HF config, read by its family's
``spec`` (:mod:`.registry`), or as a dense Llama-style model (one "expert" that every token uses, no router).
Published configs are built in (:data:`~hf_scatter.common.shapes.BUILTIN_MODELS`), so
``hf-scatter plan --model mixtral-8x7b`` works on any machine.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

from ...common.shapes import BUILTIN_MODELS, builtin_config

# Bytes per weight of the experts' formats ("": the model's dtype). MXFP4: an e2m1 nibble per weight and an e8m0
# exponent per 32 (kernels/mxfp4.py); FP8: an e4m3 byte per weight and a float32 per 128 x 128 block
# (kernels/fp8_blocks.py). Neither imported here, so planning loads no kernels.
EXPERT_FORMATS = {"": 0.0, "mxfp4": (4 + 8 / 32) / 8, "fp8": 1 + 4 / (128 * 128)}
WEIGHT_CHOICES = ("shipped", "bf16", "fp8")
SHIPPED_EXPERT_FORMATS = {"gpt-oss-20b": "mxfp4", "gpt-oss-120b": "mxfp4"}  # built-ins, as OpenAI ships them


def _checkpoint_expert_format(config) -> str:
    """The experts' format a config's ``quantization_config`` declares ("" where none the planner prices)."""
    quant = (config.get("quantization_config") if isinstance(config, dict)
             else getattr(config, "quantization_config", None))
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    method = str(getattr(method, "value", method) or "")  # transformers' QuantizationMethod enum, or a string
    dequantized = quant.get("dequantize") if isinstance(quant, dict) else getattr(quant, "dequantize", False)
    return method if method in EXPERT_FORMATS and not dequantized else ""

# GPU kernel launches per op and micro-batch, counted on the patched Mixtral layer (norm, GEMM, rotary
# embedding, residual add, routing and expert kernels). Launch-bound ops cost this many launches.
KERNELS = {"qkv": 4, "attention": 2, "o_proj": 2, "router": 4, "ffn": 6, "head": 3}
DENSE_FFN_KERNELS = 3


@dataclass(frozen=True)
class OpCost:
    """One op of one layer for ``tokens`` rows: what it computes and what it must read."""

    name: str
    flops: float
    weight_bytes: float  # weights the op reads (only the experts the tokens hit)
    kv_bytes: float  # KV cache read (attention)
    rows: float  # rows per weight matrix of its GEMMs (tokens per expert for the FFN): sets GEMM efficiency
    kernels: int  # GPU launches
    moe: bool = False  # grouped expert GEMMs (their efficiency is the profile's moe_efficiency where measured)
    weight_format: str = ""  # the weights' format where not the model's dtype ("mxfp4": decoded in the kernels)
    expert_shape: tuple = ()  # (hidden, intermediate) of one expert: its own efficiency curve where the profile has one

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only model (Mixtral/DBRX-style MoE; dense models have one expert, top-1)."""

    name: str
    family: str  # "mixtral", "dbrx" or "dense"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # per expert
    experts: int
    top_k: int
    vocab: int
    tied_embeddings: bool = False
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 2
    # DeepSeek-style MLPs besides the routed experts (0: none): the shared experts every token of an MoE layer
    # runs (their total width), and the first ``dense_layers`` layers, which hold one dense MLP instead
    shared_intermediate: int = 0
    dense_layers: int = 0
    dense_intermediate: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; 0: standard attention). Priced in the absorbed form the
    # offloaded runtime runs: the cache holds one latent "head" of ``head_dim = kv_lora_rank + qk_rope_dim``
    # per token, which is both key and value (``kv_heads = 1``), and every query head attends over it
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # The routed experts' weights as the checkpoint holds them: "mxfp4" (4.25 bits a weight, GPT-OSS as shipped),
    # or "" for the model's dtype (``dtype_bytes``)
    expert_format: str = ""
    model_type: str = ""  # transformers' model_type, where built from a config

    def __post_init__(self):
        for field in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "experts", "top_k", "vocab"):
            if int(getattr(self, field)) <= 0:
                raise ValueError(f"model {self.name!r}: {field} must be positive, got {getattr(self, field)}")
        if self.top_k > self.experts:
            raise ValueError(f"model {self.name!r}: top_k {self.top_k} exceeds the {self.experts} experts")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"model {self.name!r}: {self.dense_layers} dense layers of {self.layers}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"model {self.name!r}: expert format {self.expert_format!r} is not one of "
                             f"{', '.join(f for f in EXPERT_FORMATS if f)}")

    # ----- construction -----
    @classmethod
    def from_config(cls, config, name: str | None = None, dtype_bytes: int = 2, weights: str = "shipped"
                    ) -> "ModelSpec":
        """From a transformers config, a config dict, a config.json path or directory, or a built-in name
        (:data:`~hf_scatter.common.shapes.BUILTIN_MODELS`). ``weights``: ``"shipped"`` prices the experts in the
        format the checkpoint holds them (its ``quantization_config``; a built-in name: as its publisher ships it),
        ``"bf16"`` in the model's dtype, as a dequantized load holds them, ``"fp8"`` as a block-scaled FP8 release
        of the same model holds them (Qwen3-30B-A3B-FP8, DeepSeek-V3)."""
        if weights not in WEIGHT_CHOICES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}")
        spec = cls._from_any(config, name, dtype_bytes)
        if weights == "bf16":
            return replace(spec, expert_format="")
        if weights == "fp8":
            return replace(spec, expert_format="fp8" if spec.is_moe else "")
        if isinstance(config, str) and config in SHIPPED_EXPERT_FORMATS:
            return replace(spec, expert_format=SHIPPED_EXPERT_FORMATS[config])
        return replace(spec, expert_format=_checkpoint_expert_format(config) if spec.is_moe else "")

    @classmethod
    def _from_any(cls, config, name: str | None, dtype_bytes: int) -> "ModelSpec":
        if isinstance(config, str):
            return cls._from_name_or_path(config, dtype_bytes)
        if isinstance(config, dict):
            from transformers import AutoConfig
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            if "model_type" not in config:
                raise ValueError("model config dict has no 'model_type': pass a transformers config.json")
            if config["model_type"] not in CONFIG_MAPPING:  # transformers' own error lists all its ~500 types
                import transformers

                raise ValueError(f"model_type {config['model_type']!r} is unknown to transformers "
                                 f"{transformers.__version__} (a newer model may need a newer one); the planner reads "
                                 f"{_described()}")
            config = AutoConfig.for_model(**config)
        model_type = getattr(config, "model_type", "")
        label = name or getattr(config, "_name_or_path", "") or model_type
        from .registry import families

        family = families().get(model_type)
        if family is not None:
            return replace(family.spec(config, label, dtype_bytes), model_type=model_type)
        not_a_decoder = _not_a_decoder(config)
        if not_a_decoder:
            raise ValueError(f"model {label!r} (model_type {model_type!r}) is {not_a_decoder}; the planner prices "
                             f"the generation of decoders: {_described()}")
        if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
            raise ValueError(f"model_type {model_type!r} is a mixture-of-experts layout hf-scatter cannot describe "
                             f"yet (supported: {_described()})")
        return replace(llama_style_spec(config, label, dtype_bytes, family="dense"), model_type=model_type)

    @classmethod
    def _from_name_or_path(cls, ref: str, dtype_bytes: int) -> "ModelSpec":
        if ref in BUILTIN_MODELS:
            return cls.from_config(builtin_config(ref), name=ref, dtype_bytes=dtype_bytes)
        path = os.path.join(ref, "config.json") if os.path.isdir(ref) else ref
        if not os.path.isfile(path):
            raise ValueError(f"model {ref!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor a config.json "
                             "file or a directory holding one")
        try:
            with open(path) as f:
                config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}): pass a transformers config.json") from None
        if not isinstance(config, dict):
            raise ValueError(f"{path} holds a JSON {type(config).__name__}, not a model config: pass a transformers "
                             "config.json")
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) if path.endswith("config.json") else path
        return cls.from_config(config, name=label, dtype_bytes=dtype_bytes)

    # ----- sizes -----
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def attention_sinks(self) -> bool:
        """GPT-OSS's learnt sink logit per head: CPU attention rescales every head's output by it, which took
        12-28% more time per call than plain attention of the same shape (256 rows, H200 host)."""
        return self.family == "gpt_oss"

    @property
    def qk_norms_span_heads(self) -> bool:
        """OLMoE's q/k RMSNorms run over the whole projection: split over GPUs by heads, each norm's sums of squares
        are all-reduced too (a third, small all-reduce per layer)."""
        return self.family == "olmoe"

    @property
    def values_are_keys(self) -> bool:
        """The cached key is also the value (MLA's latent): a token's cache holds it once."""
        return self.is_mla

    @property
    def kv_width(self) -> int:
        """Elements one token caches in one layer: its keys and values (its latent alone under MLA)."""
        return self.kv_dim * (1 if self.values_are_keys else 2)

    @property
    def qkv_dim(self) -> int:
        """Width of the pre-attention output: queries, keys, and values unless the keys are the values (MLA)."""
        return self.q_dim + self.kv_width

    @property
    def expert_tensors(self) -> int:
        """Tensors of one expert that streaming copies: its input and output projections, plus DBRX's separate
        up projection or GPT-OSS's input bias."""
        return 3 if self.family in ("dbrx", "gpt_oss") else 2

    @property
    def is_moe(self) -> bool:
        return self.family != "dense"

    @property
    def moe_layer_share(self) -> float:
        """The share of layers that hold experts (the rest are DeepSeek's first dense layers)."""
        return (self.layers - self.dense_layers) / self.layers

    @property
    def _qkv_weight_elements(self) -> int:
        """Pre-attention GEMM weights. MLA: the query projection (low-rank or not), the joint latent + rotary key
        projection, and the key half of ``kv_b_proj``, which the absorbed form applies to the query."""
        if not self.is_mla:
            return self.hidden * (self.q_dim + 2 * self.kv_dim)
        q_out = self.heads * (self.qk_nope_dim + self.qk_rope_dim)
        q = self.q_lora_rank * (self.hidden + q_out) if self.q_lora_rank else self.hidden * q_out
        return q + self.hidden * (self.kv_lora_rank + self.qk_rope_dim) + self.heads * self.qk_nope_dim * self.kv_lora_rank

    @property
    def _o_weight_elements(self) -> int:
        """Output projection (MLA: after the value half of ``kv_b_proj`` takes each head's latent to its values)."""
        if not self.is_mla:
            return self.q_dim * self.hidden
        return self.heads * self.v_head_dim * (self.kv_lora_rank + self.hidden)

    @property
    def qkv_weight_bytes(self) -> float:
        """Input norm + fused Q, K, V projections (MLA: and the norms of its low-rank query and latent)."""
        norms = self.hidden + self.q_lora_rank + self.kv_lora_rank
        return (self._qkv_weight_elements + norms) * self.dtype_bytes

    @property
    def o_weight_bytes(self) -> float:
        return self._o_weight_elements * self.dtype_bytes

    @property
    def router_weight_bytes(self) -> float:
        """Post-attention norm + router (the norm alone for dense models)."""
        router = self.hidden * self.experts * self.moe_layer_share if self.is_moe else 0
        return (router + self.hidden) * self.dtype_bytes

    @property
    def expert_weight_bytes(self) -> float:
        """One expert's gate, up and down projections (GLU), in the experts' format."""
        return 3 * self.hidden * self.intermediate * self.expert_bytes_per_weight

    @property
    def expert_bytes_per_weight(self) -> float:
        return EXPERT_FORMATS[self.expert_format] or self.dtype_bytes

    @property
    def ffn_weight_bytes(self) -> float:
        """The routed experts of a layer (averaged over the layers, dense ones included)."""
        return self.experts * self.expert_weight_bytes * self.moe_layer_share

    @property
    def mlp_weight_bytes(self) -> float:
        """The MLPs every token runs, averaged over the layers: shared experts and first dense layers (0 for
        Mixtral-style models)."""
        width = self.shared_intermediate * (self.layers - self.dense_layers) + self.dense_intermediate * self.dense_layers
        return 3 * self.hidden * width / self.layers * self.dtype_bytes

    @property
    def layer_weight_bytes(self) -> float:
        """Mean bytes of a layer (``layers`` times this is every layer's)."""
        return (self.qkv_weight_bytes + self.o_weight_bytes + self.router_weight_bytes + self.ffn_weight_bytes
                + self.mlp_weight_bytes)

    @property
    def largest_layer_weight_bytes(self) -> float:
        """The largest layer: what a buffer for any one streamed layer must hold."""
        attention = self.qkv_weight_bytes + self.o_weight_bytes + self.router_weight_bytes
        moe = self.experts * self.expert_weight_bytes + 3 * self.hidden * self.shared_intermediate * self.dtype_bytes
        dense = 3 * self.hidden * self.dense_intermediate * self.dtype_bytes if self.dense_layers else 0
        return attention + (max(moe, dense) if self.dense_layers < self.layers else dense)

    @property
    def ffn_width(self) -> int:
        """MLP columns one token computes in a layer (the widest layer): its routed copies and shared experts,
        or a dense layer's MLP."""
        return max(self.top_k * self.intermediate + self.shared_intermediate,
                   self.dense_intermediate if self.dense_layers else 0)

    @property
    def other_weight_bytes(self) -> float:
        """Embedding, final norm and LM head: small, always kept on the GPU."""
        tables = 1 if self.tied_embeddings else 2
        return (tables * self.vocab * self.hidden + self.hidden) * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.layers * self.layer_weight_bytes + self.other_weight_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache of one token in one layer (K and V)."""
        return self.kv_width * self.kv_dtype_bytes

    def active_experts(self, tokens: float) -> float:
        """Expected number of distinct experts ``tokens`` tokens hit under uniform top-k routing."""
        if not self.is_moe:
            return 1.0
        return self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** max(tokens, 0.0))

    # ----- op costs -----
    def decode_ops(self, tokens: float, context_len: float) -> dict[str, OpCost]:
        """One decode step of ``tokens`` sequences (one new token each) through one layer, each attending
        to ``context_len`` cached tokens."""
        return self._ops(tokens, attention_flops=4.0 * tokens * self.q_dim * context_len,
                         kv_bytes=tokens * context_len * self.kv_bytes_per_token)

    def prefill_ops(self, tokens: float, prompt_len: float, prompt_len_sq: float | None = None) -> dict[str, OpCost]:
        """``tokens`` prompt tokens through one layer with causal attention. Prompts of mean length
        ``prompt_len`` and mean square ``prompt_len_sq``: a token sees on average E[p^2] / (2 E[p]) keys."""
        sq = prompt_len * prompt_len if prompt_len_sq is None else prompt_len_sq
        keys = sq / (2.0 * prompt_len)
        return self._ops(tokens, attention_flops=4.0 * tokens * self.q_dim * keys,
                         kv_bytes=tokens * self.kv_bytes_per_token)

    def _ops(self, tokens: float, attention_flops: float, kv_bytes: float) -> dict[str, OpCost]:
        h = self.hidden
        ops = [
            OpCost("qkv", 2.0 * tokens * self._qkv_weight_elements, self.qkv_weight_bytes, 0.0, tokens, KERNELS["qkv"]),
            OpCost("attention", attention_flops, 0.0, kv_bytes, tokens, KERNELS["attention"]),
            OpCost("o_proj", 2.0 * tokens * self._o_weight_elements, self.o_weight_bytes, 0.0, tokens,
                   KERNELS["o_proj"]),
        ]
        if self.is_moe:
            ops.append(OpCost("router", 2.0 * tokens * h * self.experts, self.router_weight_bytes, 0.0, tokens,
                              KERNELS["router"]))
        active, share = self.active_experts(tokens), self.moe_layer_share
        ops.append(OpCost("ffn", 6.0 * tokens * self.top_k * h * self.intermediate * share,
                          active * self.expert_weight_bytes * share, 0.0, tokens * self.top_k / self.experts,
                          KERNELS["ffn"] if self.is_moe else DENSE_FFN_KERNELS, moe=self.is_moe,
                          weight_format=self.expert_format, expert_shape=(h, self.intermediate) if self.is_moe else ()))
        if self.mlp_weight_bytes:  # shared experts and dense layers: every token, full rows
            ops.append(OpCost("mlp", 2.0 * tokens * self.mlp_weight_bytes / self.dtype_bytes, self.mlp_weight_bytes,
                              0.0, tokens, DENSE_FFN_KERNELS))
        return {op.name: op for op in ops}

    def head_op(self, tokens: float) -> OpCost:
        """Final norm + LM head for ``tokens`` rows."""
        return OpCost("head", 2.0 * tokens * self.hidden * self.vocab, self.vocab * self.hidden * self.dtype_bytes,
                      0.0, tokens, KERNELS["head"])

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        kind = f"{self.experts} experts, top-{self.top_k}" if self.is_moe else "dense"
        if self.shared_intermediate:
            kind += f" + shared experts of width {self.shared_intermediate}"
        if self.dense_layers:
            kind += f", {self.dense_layers} dense layer{'s' if self.dense_layers > 1 else ''} first"
        if self.is_mla:
            kind += f", latent attention (rank {self.kv_lora_rank})"
        if self.expert_format:
            kind += f" in {self.expert_format.upper()}"
        return (f"{self.name}: {self.layers} layers, hidden {self.hidden}, {kind}, {self.weight_bytes / 1e9:.1f} GB "
                f"of weights ({self.layer_weight_bytes / 1e9:.2f} GB per layer), KV "
                f"{self.kv_bytes_per_token * self.layers / 1024:.0f} KiB per token")


def _described() -> str:
    """The configs the planner reads, for errors."""
    from .registry import offloaded_model_types

    return f"{', '.join(offloaded_model_types())} and dense Llama-style decoders"


def _not_a_decoder(config) -> str | None:
    """What a config is instead of a decoder whose generation can be priced (None: a decoder, or a type transformers
    does not know). An encoder is what eval scores as a masked LM: its family has a masked LM, and the config names
    no causal-LM class and is no decoder."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                         MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    model_type = getattr(config, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in getattr(config, "architectures", None) or []):
        return None
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return "an encoder (a masked LM, no generation)"
    if model_type in CONFIG_MAPPING_NAMES and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "no causal language model (transformers has no causal-LM class for it)"
    return None


def llama_style_spec(config, label: str, dtype_bytes: int, family: str) -> ModelSpec:
    """Shapes of a Llama-style decoder config (``hidden_size``, ``num_attention_heads``, ...): dense, or with
    ``num_local_experts`` / ``num_experts_per_tok`` as Mixtral has them (``num_experts`` and
    ``moe_intermediate_size`` as Qwen-MoE and OLMoE have them)."""
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [a for a in needed if getattr(config, a, None) is None]
    if missing:
        raise ValueError(f"model_type {getattr(config, 'model_type', '')!r} is not supported: no {', '.join(missing)} "
                         f"in its config (supported: {_described()})")
    # Mixtral and GPT-OSS say num_local_experts, Qwen-MoE and OLMoE num_experts (transformers 5.17)
    experts = (getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
               if family != "dense" else None)
    heads = config.num_attention_heads
    return ModelSpec(name=label, family=family, hidden=config.hidden_size, layers=config.num_hidden_layers,
                     heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                     head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                     # one expert's width: fine-grained families keep intermediate_size for dense layers
                     intermediate=getattr(config, "moe_intermediate_size", None) or config.intermediate_size,
                     experts=experts or 1,
                     top_k=(getattr(config, "num_experts_per_tok", None) or 1) if experts else 1,
                     vocab=config.vocab_size, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                     dtype_bytes=dtype_bytes,
                     # Qwen2-MoE's shared expert, every token's (its sigmoid gate, one row, is left out)
                     shared_intermediate=(getattr(config, "shared_expert_intermediate_size", None) or 0) if experts else 0)
