"""The SwiGLU experts' output-projection backward, GEMM and one pass (``kernels/swiglu_grad_gemm.py``), against a
float64 derivation by autograd, slot by slot: fresh random inputs, odd sizes, an expert without tokens, every token on
one expert, SiLU and GPT-OSS's clamped interleaved gate, outputs poisoned with NaN."""

import pytest
import torch

from hf_scatter.kernels.swiglu import SILU, gpt_oss_gate, swiglu_reference
from hf_scatter.kernels.swiglu_grad_gemm import swiglu_grad_gemm_reference, swiglu_grad_gemm_unchecked
from hf_scatter.moe import flatten_sort_count
from test_scattermoe import poisoned_empty, rel_err, routing_case

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _expected(dy, w, idx_sorted, experts_sorted, k, gate_up, coeff, form, scale_h):
    """float64, from the definition: dA'[s] = dY[t] W_e^T, h = act(gate_up), and autograd through
    sum_s c_s h_s . dA'_s for d(gate_up)."""
    dy, w, coeff = dy.double(), w.double(), coeff.double()
    da = torch.stack([dy[t // k] @ w[e] for t, e in zip(idx_sorted.tolist(), experts_sorted.tolist())])
    gu = gate_up.double().requires_grad_(True)
    h = swiglu_reference(*form.halves(gu), *form.numbers)
    (coeff[:, None] * h * da).sum().backward()
    h = h.detach()
    return (h * da).sum(1), gu.grad, coeff[:, None] * h if scale_h else h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("pattern,h_out", [("random", "scaled"), ("empty-expert", "plain"), ("one-expert", None)])
def test_swiglu_grad_gemm_equals_the_float64_definition(device, dtype, gpt_oss, pattern, h_out):
    T, k, E, d, inter = 37, 3, 5, 48, 75
    form = gpt_oss_gate(1.702, 7.0) if gpt_oss else SILU
    idx = routing_case(T, k, E, device, pattern)
    experts_sorted, idx_sorted, offsets = flatten_sort_count(idx, E)
    M = T * k
    dy = torch.randn(T, d, device=device, dtype=dtype)
    w = torch.randn(E, d, inter, device=device, dtype=dtype) * d ** -0.5
    gate_up = torch.randn(M, 2 * inter, device=device, dtype=dtype) * (5 if gpt_oss else 2)
    if gpt_oss:
        assert (gate_up[:, 0::2] > 7).any() and (gate_up[:, 1::2].abs() > 7).any()  # both clamp branches
    coeff = torch.rand(M, device=device)
    dots_ref, d_gate_up_ref, h_ref = _expected(dy, w, idx_sorted, experts_sorted, k, gate_up, coeff, form,
                                               h_out == "scaled")
    with poisoned_empty():
        got_gate_up = gate_up.clone()
        h = torch.full((M, inter), float("nan"), device=device, dtype=dtype) if h_out else None
        dots = swiglu_grad_gemm_unchecked(dy, w, (experts_sorted, idx_sorted, offsets), k, got_gate_up, coeff, form,
                                          h_out=h, scale_h=h_out == "scaled")
    assert rel_err(dots, dots_ref) < TOL[dtype]
    assert rel_err(got_gate_up, d_gate_up_ref) < TOL[dtype]
    if h is not None:
        assert rel_err(h, h_ref) < TOL[dtype]
    if pattern == "empty-expert":
        assert offsets[0] == 0  # expert 0 has no rows: its tiles exit, every other row still written


@pytest.mark.parametrize("gpt_oss", [False, True])
def test_swiglu_grad_gemm_recomputes_the_forward_activation_bit_for_bit(device, gpt_oss):
    """The weight gradient of the output projection reads the h the epilogue recomputes: it must be the
    forward's h exactly (bf16), or dW_out would not be the gradient of the forward that ran."""
    from hf_scatter.kernels.swiglu import swiglu_fwd_unchecked

    T, k, E, d, inter = 33, 2, 4, 40, 100
    form = gpt_oss_gate(1.702, 7.0) if gpt_oss else SILU
    routing = flatten_sort_count(routing_case(T, k, E, device), E)
    dy = torch.randn(T, d, device=device, dtype=torch.bfloat16)
    w = torch.randn(E, d, inter, device=device, dtype=torch.bfloat16) * d ** -0.5
    gate_up = torch.randn(T * k, 2 * inter, device=device, dtype=torch.bfloat16) * 4
    forward_h = swiglu_fwd_unchecked(gate_up, gate_up.new_empty((T * k, inter)), form)
    got_h = torch.full_like(forward_h, float("nan"))
    swiglu_grad_gemm_unchecked(dy, w, routing, k, gate_up.clone(), torch.rand(T * k, device=device), form,
                               h_out=got_h, scale_h=False)
    assert torch.equal(got_h, forward_h)
    ref_gate_up = gate_up.clone()
    swiglu_grad_gemm_reference(dy, w, *routing, k, ref_gate_up, torch.ones(T * k, device=device), form)
    got_gate_up = gate_up.clone()
    swiglu_grad_gemm_unchecked(dy, w, routing, k, got_gate_up, torch.ones(T * k, device=device), form)
    assert rel_err(got_gate_up, ref_gate_up) < 1e-2  # without h_out: only the gradient is written
