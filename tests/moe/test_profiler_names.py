"""Every hf-scatter op carries an ``hf_scatter::`` name in a torch profiler trace (eager calls skip the
custom-op dispatcher, so without these ranges a trace would not show them), and with no profiler active
no ``record_function`` is made at all (the eager fast path stays as it was)."""

import pytest
import torch
from torch.profiler import profile

import hf_scatter
from hf_scatter.kernels.backend import kernel_path
from hf_scatter.tiny import tiny_mixtral

# What a patched Mixtral's training step runs: routing, the SwiGLU experts as one autograd function and
# their kernels, the fused add + RMSNorm, the fused router and the fused loss's per-row kernel.
MIXTRAL_NAMES = {
    "flatten_sort_count", "swiglu_experts.forward", "swiglu_experts.backward", "scatter2scatter", "group",
    "groupxty", "gate_mix", "scatter2scatter_swiglu", "swiglu_grad_gemm", "add_norm.forward", "add_norm.backward",
    "add_norm_fwd", "add_norm_bwd", "router_topk.forward", "router_topk.backward", "router_topk",
    "cross_entropy_rows",
}
# The other public calls: ParallelLinear, the SwiGLU autograd functions, the masked softmax, varlen attention.
OTHER_NAMES = {
    "parallel_linear.forward", "parallel_linear.backward", "gate_grad", "swiglu.forward", "swiglu.backward",
    "swiglu_fwd", "swiglu_bwd",
    "swiglu_pair.forward", "swiglu_pair.backward", "masked_softmax.forward", "masked_softmax.backward",
    "masked_softmax_fwd", "masked_softmax_bwd", "varlen_attention",
}


def _mixtral_step(device):
    model = hf_scatter.patch_model(tiny_mixtral(hidden=40, intermediate=56, layers=1, experts=4, top_k=2).to(device))
    model.train()  # the fused loss runs in training only
    ids = torch.randint(3, 300, (1, 7), device=device, generator=torch.Generator(device).manual_seed(0))
    model(ids, labels=ids).loss.backward()


def _other_calls(device):
    from hf_scatter.kernels.norms import fused_add_layer_norm
    from hf_scatter.kernels.softmax import fused_masked_softmax
    from hf_scatter.kernels.swiglu import swiglu, swiglu_pair
    from hf_scatter.kernels.varlen_attention import varlen_attention
    from hf_scatter.moe import flatten_sort_count, parallel_linear

    T, k, E = 5, 2, 3
    idx = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)])
    w = torch.randn(E, 12, 10, device=device, requires_grad=True)
    gates = torch.rand(T, k, device=device, requires_grad=True)
    x = torch.randn(T, 12, device=device, requires_grad=True)
    parallel_linear(x, w, k, *flatten_sort_count(idx, E), gates=gates).sum().backward()
    h = torch.randn(7, 18, device=device, requires_grad=True)
    swiglu(h).sum().backward()
    g, u = torch.randn(7, 9, device=device, requires_grad=True), torch.randn(7, 9, device=device, requires_grad=True)
    swiglu_pair(g, u).sum().backward()
    scores = torch.randn(1, 2, 5, 5, device=device, requires_grad=True)
    fused_masked_softmax(scores, torch.zeros(1, 1, 1, 5, device=device), scale=0.5).sum().backward()
    q = torch.randn(9, 2, 8, device=device)
    varlen_attention(q, q, q, [4, 5])
    with torch.no_grad():  # the inference path of the norms: no autograd function, the kernel op alone
        fused_add_layer_norm(q.view(9, 16), q.view(9, 16), torch.ones(16, device=device), None)


def _names(prof) -> set[str]:
    return {e.key.removeprefix("hf_scatter::") for e in prof.key_averages() if e.key.startswith("hf_scatter::")}


@pytest.fixture(params=["torch-reference", "triton"])
def kernel_choice(request, monkeypatch, device):
    if request.param == "torch-reference":
        monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
    elif kernel_path(device) == "torch":
        pytest.skip("Triton kernels do not run here")
    return request.param


def test_every_op_is_named_under_the_profiler(device, kernel_choice):
    with profile() as prof:
        _mixtral_step(device)
    missing = MIXTRAL_NAMES - _names(prof)
    assert not missing, f"not in the trace of a patched Mixtral step ({kernel_choice}): {sorted(missing)}"
    with profile() as prof:
        _other_calls(device)
    missing = (OTHER_NAMES | {"add_norm_fwd"}) - _names(prof)
    assert not missing, f"not in the trace ({kernel_choice}): {sorted(missing)}"


def test_names_match_the_registered_ops():
    """The eager ranges carry the custom ops' own names: a compiled trace (which runs the ops) reads the same."""
    from hf_scatter.kernels import custom_ops as ops
    from hf_scatter.kernels import (gating, group, groupxty, linear_cross_entropy, norms, router,  # noqa: F401
                                    scatter2scatter, softmax, swiglu, swiglu_grad_gemm,
                                    varlen_attention)  # (they register their ops)

    assert len(ops._profile_names) >= 13
    for op, name in ops._profile_names.items():
        assert name == f"hf_scatter::{op._name}" and getattr(torch.ops.hf_scatter, op._name) is not None


def test_no_record_function_without_a_profiler(monkeypatch, device):
    made = []
    init = torch.autograd.profiler.record_function.__init__

    def spy(self, name, *args, **kwargs):
        made.append(name)
        init(self, name, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__init__", spy)
    assert not torch.autograd.profiler._is_profiler_enabled
    _mixtral_step(device)
    _other_calls(device)
    assert not [n for n in made if n.startswith("hf_scatter::")], made
    with profile():  # the spy does see them once a profiler runs
        _other_calls(device)
    assert any(n.startswith("hf_scatter::") for n in made)
