"""Shared cases of the offload runtime's tests: tiny models of every offloaded family, requests, padding, the
vanilla reference, and the fixture that runs the kernels' torch references on the CPU stand-in."""

import math

import pytest
import torch

from hf_scatter.models.mxfp4_experts import quantize_gpt_oss_experts
from hf_scatter.tiny import TINY_BUILDERS


def with_random(model, suffixes: tuple[str, ...], scale: float = 0.1, seed: int = 1):
    """``model`` with every parameter or buffer ending in one of ``suffixes`` random (transformers starts biases
    at zero, which would hide a bias added twice or not at all)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(suffixes):
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return model


def tiny_gpt_oss_with_biases(**config):
    """GPT-OSS with every bias and attention sink random: sinks of the scale of a score, biases of a weight
    row's. Its tiny config has a sliding window of 8 on every other layer, shorter than most test prompts."""
    model = with_random(TINY_BUILDERS["gpt_oss"](**config), ("bias",))
    return with_random(model, ("sinks",), scale=1.0, seed=2)


def tiny_deepseek_v3_with_biases(**config):
    """DeepSeek-V3 with the attention's biases and the router's score-correction bias random (the bias moves the
    choice of experts only)."""
    model = TINY_BUILDERS["deepseek_v3"](attention_bias=True, **config)
    return with_random(with_random(model, ("proj.bias", "proj_with_mqa.bias")), ("e_score_correction_bias",),
                       scale=1.0, seed=3)


def tiny_deepseek_v2_lite_style(**config):
    """DeepSeek-V2 as V2-Lite has it: a full-rank query projection (no q_lora_rank); MLP biases random."""
    return with_random(TINY_BUILDERS["deepseek_v2"](q_lora_rank=None, mlp_bias=True, **config), ("bias",))


def tiny_qwen2_moe_windowed(**config):
    """Qwen2-MoE with a sliding window of 8 on its first layer (``layer_types``), q/k/v biases and the shared
    expert's gate random (transformers starts the biases at zero)."""
    model = TINY_BUILDERS["qwen2_moe"](use_sliding_window=True, sliding_window=8, max_window_layers=1, **config)
    assert model.config.layer_types[0] == "sliding_attention"
    return with_random(model, ("bias", "shared_expert_gate.weight"), scale=0.5)


def with_attention_biases(family, **preset):
    """``family`` with ``attention_bias`` set and the biases random (published Qwen3-MoE and OLMoE checkpoints have
    none, but their configs allow them)."""
    return lambda **config: with_random(TINY_BUILDERS[family](attention_bias=True, **preset, **config), ("bias",),
                                        scale=0.5)


def tiny_gpt_oss_mxfp4(**config):
    """GPT-OSS with its experts in MXFP4, as a checkpoint loaded as shipped holds them."""
    return quantize_gpt_oss_experts(tiny_gpt_oss_with_biases(**config))


# OLMoE with its clip_qkv set (published checkpoints leave it None), so the clamp after the q/k norms runs
BUILDERS = {**TINY_BUILDERS, "qwen3_moe": with_attention_biases("qwen3_moe"),
            "olmoe": with_attention_biases("olmoe", clip_qkv=0.3),
            "gpt_oss": tiny_gpt_oss_with_biases, "deepseek_v3": tiny_deepseek_v3_with_biases,
            "deepseek_v2": tiny_deepseek_v2_lite_style, "qwen2_moe": tiny_qwen2_moe_windowed,
            "granitemoe": with_attention_biases("granitemoe"),  # its tiny config: every multiplier away from 1
            "gpt_oss_mxfp4": tiny_gpt_oss_mxfp4}
# the families with a pipeline adapter (and GPT-OSS's experts as shipped)
OFFLOADED = ["mixtral", "dbrx", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "deepseek_v2", "qwen2_moe",
             "granitemoe", "gpt_oss_mxfp4"]


@pytest.fixture(autouse=True)
def torch_kernels_on_cpu(request, monkeypatch):
    """The kernels have their own interpreted tests; here the pipeline is under test, so the CPU stand-in
    runs their torch references (GPU tests keep the Triton kernels). Tiny models run fastest on one thread
    (several spin against each other and against the CPU attention worker on a small CI machine)."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
LENS = (5, 17, 9, 30, 3, 12, 21)


def requests(lens=LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g) for n in lens]


def padded(reqs, side="left"):
    longest = max(len(r) for r in reqs)
    ids = torch.zeros(len(reqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(reqs):
        sl = slice(longest - len(r), longest) if side == "left" else slice(0, len(r))
        ids[i, sl] = r
        mask[i, sl] = 1
    return ids, mask


def vanilla_new_tokens(model, reqs, max_new_tokens, **kw):
    """Greedy tokens of each request alone (no padding anywhere): the reference."""
    out = []
    for r in reqs:
        seq = model.generate(r[None], attention_mask=torch.ones(1, len(r), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw)
        out.append(seq[0, len(r):].tolist())
    return out


def strip(tokens, pad=0, eos=None):
    """HF pads a finished row after its EOS: the generated part up to and including EOS."""
    if eos is not None and eos in tokens:
        return tokens[:tokens.index(eos) + 1]
    return tokens


def reference_attention(q, k, v, window=None, sinks=None, scale=None):
    """float64, K/V expanded per query head: ``q`` [H, d] at the last of ``k``/``v``'s [S, Hkv, d] positions."""
    H, d = q.shape
    S = k.shape[0]
    k = k.double().repeat_interleave(H // k.shape[1], dim=1).transpose(0, 1)  # [H, S, d]
    v = v.double().repeat_interleave(H // v.shape[1], dim=1).transpose(0, 1)
    scale = 1 / math.sqrt(d) if scale is None else scale
    scores = (q.double().unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale  # [H, S]
    if window is not None:
        scores[:, :max(0, S - window)] = float("-inf")
    if sinks is not None:
        probs = torch.cat([scores, sinks.double()[:, None]], 1).softmax(-1)[:, :-1]
    else:
        probs = scores.softmax(-1)
    return (probs.unsqueeze(1) @ v).reshape(-1)


def fp32_exact():
    """GPU matmuls in full float32 (no TF32), for token equality with the fp32 reference."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
