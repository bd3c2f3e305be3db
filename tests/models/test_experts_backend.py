"""The "scattermoe" ExpertsInterface backend honours every layout flag of ``use_experts_implementation``:
gated or not, transposed storage, biases, interleaved gate/up with a family-specific gate, post-expert norm.
Each experts class transformers ships with that layout runs against its own eager forward."""

import copy
import importlib
import types

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


@pytest.mark.parametrize("told_by", ["module flag", "distributed config"])
@pytest.mark.parametrize("case,classes", PRESENT, ids=[c[0][0] for c in PRESENT])
def test_expert_parallel_shard_skips_routes_to_other_ranks(case, classes, told_by, device):
    """Expert parallelism hands a rank its local experts (here 3 of 6) and, in transformers' all-reduce dispatch,
    marks routes to other ranks' experts with id ``num_local`` and weight 0. The shard's output and gradients
    are those of the full experts with the other ranks' routes dropped, and those routes are not computed: a
    token routed to other ranks only gets exactly zero from this rank even when its hidden state is not finite
    (computed with weight 0, inf would give NaN). Releases with ``ep_size`` flag the module; earlier ones keep
    ``DistributedConfig(enable_expert_parallel=True)`` on the config."""
    config_cls, experts_cls = classes
    config = config_cls(**case[3])
    torch.manual_seed(0)
    full = experts_cls(copy.copy(config)).to(device)
    for p in full.parameters():
        torch.nn.init.normal_(p, std=0.2)
    full.config._experts_implementation = "eager"
    shard = copy.deepcopy(full)
    shard.config = copy.copy(config)
    shard.config._experts_implementation = SCATTERMOE
    E, local = 6, 3  # this rank holds experts 3, 4, 5
    with torch.no_grad():
        for name, p in full.named_parameters(recurse=False):  # per-expert tensors: this rank's slice
            if p.shape[0] == E:
                setattr(shard, name, torch.nn.Parameter(p[local:].clone()))
    shard.num_experts = local
    if told_by == "module flag":
        shard._is_expert_parallel = True
    else:
        shard.config.distributed_config = types.SimpleNamespace(enable_expert_parallel=True)

    T, k, H = 19, 2, 72
    idx = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(device)
    idx[0] = torch.tensor([0, 1])  # a token routed to other ranks only
    weights = torch.rand(T, k, device=device).softmax(-1)
    off_rank = idx < local
    x = torch.randn(T, H, device=device)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    w1, w2 = weights.masked_fill(off_rank, 0.0).requires_grad_(True), weights.clone().requires_grad_(True)
    want = full(x1, idx, w1)  # the other ranks' routes weigh nothing
    local_idx = torch.where(off_rank, local, idx - local)
    got = shard(x2, local_idx, w2.masked_fill(off_rank, 0.0))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got[0].abs().max() == 0
    dy = torch.randn_like(want)
    want.backward(dy)
    got.backward(dy)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w2.grad, w1.grad.masked_fill(off_rank, 0.0), rtol=1e-4, atol=1e-5)
    for name, p in shard.named_parameters(recurse=False):
        if getattr(full, name).shape[0] != E:
            continue
        torch.testing.assert_close(p.grad, getattr(full, name).grad[local:], rtol=1e-4, atol=1e-5, msg=name)
        assert getattr(full, name).grad[:local].abs().max() == 0  # nothing this rank computes belongs there
    poisoned = x.clone()
    poisoned[0] = float("inf")
    with torch.no_grad():
        out = shard(poisoned, local_idx, weights.masked_fill(off_rank, 0.0))
    assert (out[0] == 0).all() and torch.isfinite(out[1:]).all()
