"""The "scattermoe" ExpertsInterface backend honours every layout flag of ``use_experts_implementation``:
gated or not, transposed storage, biases, interleaved gate/up with a family-specific gate, post-expert norm.
Each experts class transformers ships with that layout runs against its own eager forward."""

import copy
import importlib

import pytest
import torch

from hf_scatter.models.experts import SCATTERMOE

# (model_type, config class, experts class, config kwargs, what it exercises)
CASES = [
    ("mixtral", "MixtralConfig", "MixtralExperts",
     dict(hidden_size=72, intermediate_size=40, num_local_experts=6), "fused [gate; up], SiLU"),
    ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeExperts",
     dict(hidden_size=72, moe_intermediate_size=40, num_experts=6), "fused [gate; up], SiLU"),
    ("gpt_oss", "GptOssConfig", "GptOssExperts",
     dict(hidden_size=72, intermediate_size=40, num_local_experts=6), "transposed, biases, interleaved, clamped gate"),
    ("nemotron_h", "NemotronHConfig", "NemotronHExperts",
     dict(hidden_size=72, moe_intermediate_size=40, n_routed_experts=6), "no gate (up, relu2, down)"),
    ("muse_spark", "MuseSparkTextConfig", "MuseSparkExperts",
     dict(moe_hidden_size=72, moe_intermediate_size=40, num_local_experts=6), "post-expert norm"),
]


def _available(case):
    model_type, config_cls, experts_cls = case[:3]
    try:
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        configuration = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    except ImportError:
        return None
    if not hasattr(modeling, experts_cls) or not hasattr(configuration, config_cls):
        return None
    return getattr(configuration, config_cls), getattr(modeling, experts_cls)


# Families this transformers version ships (older 5.x lack some): each present one is tested.
PRESENT = [(case, classes) for case in CASES if (classes := _available(case)) is not None]


@pytest.mark.parametrize("case,classes", PRESENT, ids=[c[0][0] for c in PRESENT])
def test_backend_matches_the_familys_eager_experts(case, classes, device):
    config_cls, experts_cls = classes
    model_type = case[0]
    config = config_cls(**case[3])
    torch.manual_seed(0)
    eager = experts_cls(config).to(device)
    std = 0.6 if model_type == "gpt_oss" else 0.2  # GPT-OSS: activations past its clamp limit, both branches
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=std)
    ours = copy.deepcopy(eager)
    eager.config, ours.config = copy.copy(config), copy.copy(config)
    eager.config._experts_implementation, ours.config._experts_implementation = "eager", SCATTERMOE
    T, k, E, H = 23, 3, 6, 72
    x = torch.randn(T, H, device=device, requires_grad=True)
    weights = torch.rand(T, k, device=device).softmax(-1).requires_grad_(True)
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(device)
    x2, weights2 = x.detach().clone().requires_grad_(True), weights.detach().clone().requires_grad_(True)
    want, got = eager(x, idx, weights), ours(x2, idx, weights2)
    if model_type == "gpt_oss":
        with torch.no_grad():
            pre = x @ eager.gate_up_proj[0] + eager.gate_up_proj_bias[0]
        assert (pre.abs() > eager.limit).float().mean() > 0.05, "the test must reach the clamp"

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert got.shape == want.shape and rel(got, want) < 1e-5
    dy = torch.randn_like(want)
    want.backward(dy)
    got.backward(dy)
    assert rel(x2.grad, x.grad) < 1e-5 and rel(weights2.grad, weights.grad) < 1e-5
    for (name, p_eager), p_ours in zip(eager.named_parameters(), ours.parameters()):
        assert rel(p_ours.grad, p_eager.grad) < 1e-5, name


def test_expert_parallel_experts_get_a_clear_error(device):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from hf_scatter.tiny import tiny_mixtral_config

    config = tiny_mixtral_config()
    config._experts_implementation = SCATTERMOE
    experts = MixtralExperts(config).to(device)
    experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="expert-parallel.*grouped_mm"):
        experts(torch.randn(4, 64, device=device), torch.zeros(4, 2, dtype=torch.long, device=device),
                torch.ones(4, 2, device=device))
