"""GLUMLP against transformers' own Mixtral experts, Mixture-of-Attention against a plain float64 loop,
torch.compile(fullgraph=True) of an SMoE MLP, and the visible torch fallback."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from hf_scatter.moe import GLUMLP, MixtureOfAttention, glu_experts


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _routing(T, k, E, device):
    logits = torch.randn(T, E, device=device)
    gates, idx = F.softmax(logits, -1).topk(k, -1)
    return idx, (gates / gates.sum(-1, keepdim=True)).requires_grad_(True)


# hidden <= I: the backward copies X and dY into expert order; hidden > 2I (fine-grained): reads both in place
@pytest.mark.parametrize("hidden,intermediate", [(72, 100), (96, 40)])
def test_glu_mlp_matches_hf_mixtral_experts(device, hidden, intermediate):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from hf_scatter.tiny import tiny_mixtral_config

    cfg = tiny_mixtral_config(hidden=hidden, experts=6, top_k=3, intermediate=intermediate)
    hf = MixtralExperts(cfg).to(device)
    torch.nn.init.normal_(hf.gate_up_proj, std=0.1)
    torch.nn.init.normal_(hf.down_proj, std=0.1)
    ours = GLUMLP(6, hidden, intermediate).to(device)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(37, hidden, device=device, requires_grad=True)
    idx, gates = _routing(37, 3, 6, device)
    x2, gates2 = x.detach().clone().requires_grad_(True), gates.detach().clone().requires_grad_(True)
    want = hf(x, idx, gates)
    got = ours(x2, idx, gates2)
    assert _rel(got, want) < 1e-5
    dy = torch.randn_like(want)
    want.backward(dy)
    got.backward(dy)
    assert _rel(x2.grad, x.grad) < 1e-5
    assert _rel(gates2.grad, gates.grad) < 1e-5
    assert _rel(ours.gate_up_proj.grad, hf.gate_up_proj.grad) < 1e-5
    assert _rel(ours.down_proj.grad, hf.down_proj.grad) < 1e-5


def test_swiglu_experts_backward_frees_its_activations_and_refuses_a_second_pass(device):
    """The SMoE MLP keeps only its [T*k, 2I] pre-activation for the backward (the [T*k, I] SwiGLU output is
    recomputed there) and hands it back during the backward (that is what keeps its peak low); a second
    backward through the same graph is a clear error, not a read of freed memory."""
    mlp = GLUMLP(4, 32, 24).to(device)
    x = torch.randn(11, 32, device=device, requires_grad=True)
    idx, gates = _routing(11, 2, 4, device)
    y = glu_experts(x, mlp.gate_up_proj, mlp.down_proj, idx, gates)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None and t.dim() == 2 and t.shape[0] == 22]  # [T*k, *]
    assert [t.shape[1] for t in saved] == [48]
    y.sum().backward(retain_graph=True)
    assert all(t.untyped_storage().nbytes() == 0 for t in saved)
    with pytest.raises(RuntimeError, match="backward through the SwiGLU experts ran twice"):
        y.sum().backward()


@pytest.mark.parametrize("fused", [True, False], ids=["swiglu-experts", "parallel-linear-chain"])
def test_experts_keep_no_view_of_a_weight_that_zero3_frees_and_gathers_again(device, fused):
    """DeepSpeed ZeRO-3 frees a gathered parameter after forward by giving it new, empty data and gathers it
    again before backward. The experts' saved tensors must then hold nothing of the freed weight (a saved
    transposed view would keep every layer's whole weight alive until backward) and the backward must read
    the weight gathered again: the same gradients as without the swap."""
    from hf_scatter.moe.mlp import expert_mlp, glu_activation

    mlp = GLUMLP(5, 24, 20).to(device)
    x = torch.randn(13, 24, device=device, requires_grad=True)
    idx, gates = _routing(13, 2, 5, device)
    act = glu_activation(F.silu) if fused else (lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1])  # one node / a chain

    def run(swap: bool):
        mlp.zero_grad(set_to_none=True)
        y = expert_mlp(x, (mlp.gate_up_proj.transpose(1, 2),), mlp.down_proj.transpose(1, 2), idx, gates, act)
        if swap:
            gathered = {p: p.data for p in mlp.parameters()}
            for p in mlp.parameters():
                p.data = torch.empty(0, device=device, dtype=p.dtype)  # released, as ZeRO-3 does
            nodes, seen = [y.grad_fn], []
            while nodes:  # every saved tensor of the graph, in every node
                node = nodes.pop()
                if node is None or node in seen:
                    continue
                seen.append(node)
                for t in getattr(node, "saved_tensors", ()) or ():
                    if t is not None and t.numel():
                        assert all(t.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
                                   for g in gathered.values()), "a saved tensor holds a released weight"
                nodes.extend(n for n, _ in node.next_functions)
            for p in mlp.parameters():
                p.data = gathered[p].clone()  # gathered again into new memory before backward
        y.backward(torch.ones_like(y))
        return [p.grad.clone() for p in mlp.parameters()]

    for got, want in zip(run(True), run(False)):
        torch.testing.assert_close(got, want)


def test_swiglu_experts_without_gradients_make_no_autograd_node_and_the_same_output(device):
    """Generation (no_grad, or nothing requiring grad) runs the forward without an autograd node (its host time
    is a decode step's to spare) and gives bit-for-bit the training path's output."""
    mlp = GLUMLP(5, 32, 24).to(device)
    x = torch.randn(9, 32, device=device)
    idx, gates = _routing(9, 2, 5, device)
    trained = glu_experts(x, mlp.gate_up_proj, mlp.down_proj, idx, gates)
    assert trained.grad_fn is not None
    with torch.no_grad():
        generated = glu_experts(x, mlp.gate_up_proj, mlp.down_proj, idx, gates)
    frozen = glu_experts(x, mlp.gate_up_proj.detach(), mlp.down_proj.detach(), idx, gates.detach())
    for y in (generated, frozen):
        assert y.grad_fn is None and torch.equal(y, trained.detach())


def _moa_reference(moa, x, is_causal, attention_mask, p=None):
    """Per expert choice j, per head: dense float64 attention over the shared K/V (``p``: float64 parameters,
    leaves for gradients; default a detached copy of the module's)."""
    p = p if p is not None else {n: t.detach().double() for n, t in moa.named_parameters()}
    B, S, H = x.shape
    k, h, d, kvh = moa.top_k, moa.num_heads, moa.head_dim, moa.num_kv_heads
    xd = x.double()
    probs = F.softmax(xd @ p["router.weight"].t(), -1)
    gates, idx = probs.topk(k, -1)
    gates = gates / gates.sum(-1, keepdim=True)
    kv = (xd @ p["kv_proj.weight"].t()).view(B, S, 2, kvh, d)
    key, value = kv[:, :, 0], kv[:, :, 1]
    allowed = torch.ones(S, S, dtype=torch.bool, device=x.device)
    if is_causal:
        allowed = allowed.tril()
    out = torch.zeros(B, S, H, dtype=torch.float64, device=x.device)
    for j in range(k):
        e = idx[:, :, j]  # [B, S]
        q = torch.einsum("bsi,bsoi->bso", xd, p["q_proj"][e]).view(B, S, h, d)
        heads = []
        for hh in range(h):
            kv_head = hh // (h // kvh)
            scores = torch.einsum("bsd,btd->bst", q[:, :, hh], key[:, :, kv_head]) / math.sqrt(d)
            mask = allowed[None]
            if attention_mask is not None:
                mask = mask & attention_mask[:, None, :].bool()
            scores = scores.masked_fill(~mask, -1e30)  # finite: fully masked rows stay finite (no NaN gradients)
            heads.append(torch.einsum("bst,btd->bsd", scores.softmax(-1), value[:, :, kv_head]))
        o = torch.cat(heads, -1)  # [B, S, h*d]
        out += gates[:, :, j, None] * torch.einsum("bsi,bsoi->bso", o, p["o_proj"][e])
    return out


@pytest.mark.parametrize("kv_heads,is_causal,masked", [(4, True, False), (2, True, True), (4, False, False)])
def test_mixture_of_attention_matches_reference(device, kv_heads, is_causal, masked):
    """Output and every gradient (x, router, Q, O, shared K/V) against float64: O mixes each token's k slots
    through parallel_linear's [T, k] gates over one input row per slot."""
    torch.manual_seed(0)
    moa = MixtureOfAttention(hidden_size=48, num_experts=5, top_k=2, num_heads=4, head_dim=12,
                             num_kv_heads=kv_heads).to(device)
    x = torch.randn(2, 11, 48, device=device, requires_grad=True)
    mask = None
    if masked:
        mask = torch.ones(2, 11, dtype=torch.bool, device=device)
        mask[1, :3] = False  # left padding in the second sequence
    params = {n: t.detach().double().requires_grad_(True) for n, t in moa.named_parameters()}
    rx = x.detach().double().requires_grad_(True)
    got = moa(x, attention_mask=mask, is_causal=is_causal)
    want = _moa_reference(moa, rx, is_causal, mask, params)
    # Fully masked query rows (causal, left-padded) are undefined in both: no output check, no gradient.
    rows = torch.ones(2, 11, dtype=torch.bool, device=device)
    if masked and is_causal:
        rows[1, :3] = False
    assert _rel(got[rows], want[rows]) < 1e-5
    dy = torch.randn_like(got) * rows[..., None]
    got.backward(dy)
    want.backward(dy.double())
    for name, param in moa.named_parameters():
        assert _rel(param.grad, params[name].grad) < 1e-5, name
    assert _rel(x.grad, rx.grad) < 1e-5


def test_torch_compile_fullgraph_smoe_mlp(device):
    torch._dynamo.reset()
    mlp = GLUMLP(4, 32, 48).to(device)
    x = torch.randn(19, 32, device=device, requires_grad=True)
    idx, gates = _routing(19, 2, 4, device)

    def step(x, idx, gates):
        return glu_experts(x, mlp.gate_up_proj, mlp.down_proj, idx, gates, validate=False)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device.type == "cpu" else "inductor")
    got = compiled(x, idx, gates)
    want = step(x, idx, gates)
    assert _rel(got, want) < 1e-6
    got.sum().backward()
    g_compiled = mlp.gate_up_proj.grad.clone()
    mlp.gate_up_proj.grad = None
    want.sum().backward()
    assert _rel(g_compiled, mlp.gate_up_proj.grad) < 1e-6


def test_torch_fallback_is_selected_visibly(monkeypatch, device):
    from hf_scatter.kernels import backend

    # The kernels asked for (HF_SCATTER_KERNELS=triton) where they cannot run (no GPU, no interpreter): the
    # reference path runs and says so, once per op.
    with monkeypatch.context() as m:
        m.setattr(backend, "kernels_enabled", lambda: False)
        m.setattr(backend, "_warned", set())
        m.setenv("HF_SCATTER_KERNELS", "triton")
        x = torch.randn(5, 8)
        assert backend.kernel_path(x.device) == "torch"
        with pytest.warns(RuntimeWarning, match="pure-torch reference path"):
            assert backend.use_triton(x, "scatter2scatter") is False
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # only once per op
            assert backend.use_triton(x, "scatter2scatter") is False
        if not torch.cuda.is_available():  # not asked for, on a machine without a GPU: the designed path, silent
            m.delenv("HF_SCATTER_KERNELS")
            m.setattr(backend, "_warned", set())
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert backend.use_triton(x, "scatter2scatter") is False
    # The forced reference path computes the same function as the kernels on this machine.
    mlp = GLUMLP(3, 8, 12).to(device)
    x = torch.randn(5, 8, device=device)
    idx, gates = _routing(5, 2, 3, device)
    monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
    assert backend.kernel_path(device) == "torch"
    y_torch = mlp(x, idx, gates)
    monkeypatch.setenv("HF_SCATTER_KERNELS", "auto")
    assert backend.kernel_path(device) != "torch"
    assert _rel(y_torch, mlp(x, idx, gates)) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_swiglu_forward_backward(device, dtype, tol):
    from hf_scatter.kernels.swiglu import swiglu

    h = torch.randn(37, 2 * 150, device=device, dtype=dtype) * 3
    ref_h = h.detach().double().requires_grad_(True)
    gate, up = ref_h.chunk(2, -1)
    ref = F.silu(gate) * up
    out = swiglu(h.clone().requires_grad_(True))
    assert _rel(out, ref) < tol
    leaf = h.clone().requires_grad_(True)
    dout = torch.randn(37, 150, device=device, dtype=dtype)
    swiglu(leaf).backward(dout)
    ref.backward(dout.double())
    assert _rel(leaf.grad, ref_h.grad) < tol
    assert torch.equal(leaf.detach(), h), "without reuse_input_buffer the input must be untouched"
    inner = h.clone().requires_grad_(True)
    swiglu(inner * 1, reuse_input_buffer=True).backward(dout)
    assert _rel(inner.grad, ref_h.grad) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_swiglu_pair_forward_backward(device, dtype, tol):
    """DBRX's gate and up come from two projections: separate operands, strided rows, odd sizes."""
    from hf_scatter.kernels.swiglu import swiglu_pair

    g = (torch.randn(29, 160, device=device, dtype=dtype) * 3)[:, :77]  # row stride 160, width 77
    u = torch.randn(29, 77, device=device, dtype=dtype) * 3
    rg, ru = g.double().requires_grad_(True), u.double().requires_grad_(True)
    ref = F.silu(rg) * ru
    dout = torch.randn(29, 77, device=device, dtype=dtype)
    ref.backward(dout.double())
    lg, lu = g.detach().requires_grad_(True), u.clone().requires_grad_(True)
    assert lg.stride(0) == 160
    out = swiglu_pair(lg, lu)
    assert _rel(out, ref) < tol
    out.backward(dout)
    assert _rel(lg.grad, rg.grad) < tol and _rel(lu.grad, ru.grad) < tol
    ig, iu = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    swiglu_pair(ig * 1, iu * 1, reuse_input_buffers=True).backward(dout)
    assert _rel(ig.grad, rg.grad) < tol and _rel(iu.grad, ru.grad) < tol
    with pytest.raises(ValueError, match="swiglu_pair"):
        swiglu_pair(g, u[:, :70])


def _gpt_oss_gate_reference(gate_up, alpha=1.702, limit=7.0):
    """GPT-OSS's own formula (transformers' GptOssExperts._apply_gate), in whatever dtype it is given."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_gpt_oss_gate_forward_backward_with_clamping(device, dtype, tol):
    """GPT-OSS's clamped gate over interleaved [g0, u0, g1, u1, ...] columns, forward and backward, against a
    float64 reference; values straddle the clamp limits, so both clamp branches (and their zero gradients)
    are exercised; outputs are poisoned first; odd sizes."""
    from hf_scatter.kernels.swiglu import _interleaved, gpt_oss_gate, swiglu_bwd_unchecked, swiglu_fwd_unchecked

    form = gpt_oss_gate(1.702, 7.0)
    M, I = 37, 75
    h = torch.randn(M, 2 * I, device=device, dtype=dtype) * 6
    assert (h[:, 0::2] > 7).any() and (h[:, 1::2].abs() > 7).any()
    assert _interleaved(*form.halves(h)), "the kernel reads interleaved rows as one contiguous tile"
    ref_h = h.detach().double().requires_grad_(True)
    ref = _gpt_oss_gate_reference(ref_h)
    out = torch.full((M, I), float("nan"), device=device, dtype=dtype)
    swiglu_fwd_unchecked(h, out, form)
    assert _rel(out, ref) < tol
    dout = torch.randn(M, I, device=device, dtype=dtype)
    ref.backward(dout.double())
    dh = torch.full_like(h, float("nan"))
    swiglu_bwd_unchecked(h, dout, dh, form)
    assert _rel(dh, ref_h.grad) < tol
    assert (dh[:, 0::2][h[:, 0::2] > 7] == 0).all() and (dh[:, 1::2][h[:, 1::2].abs() > 7] == 0).all()
    inplace = h.clone()
    swiglu_bwd_unchecked(inplace, dout, inplace, form)  # the experts' backward writes over its input
    assert torch.equal(inplace, dh)


def test_the_backend_runs_gpt_oss_experts_on_the_fused_gate():
    """GPT-OSS's own gate is recognised and handed to the fused SwiGLU experts (its eager equality, past the
    clamp, is tests/models/test_experts_backend.py's)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from hf_scatter.kernels.swiglu import gpt_oss_gate
    from hf_scatter.models.experts import _fused_gate_form

    eager = GptOssExperts(GptOssConfig(hidden_size=40, intermediate_size=24, num_local_experts=5))
    assert _fused_gate_form(eager) == gpt_oss_gate(eager.alpha, eager.limit)


def _force_library_gemm(monkeypatch, on: bool):
    """Make the expert weight gradients, and the SwiGLU experts' output projection and input gradient, take (or
    avoid) the library grouped GEMM, whatever the device and batch size."""
    import importlib

    for name in ("hf_scatter.moe.parallel_linear", "hf_scatter.moe.swiglu_experts"):  # the modules, not the functions
        monkeypatch.setattr(importlib.import_module(name), "grouped_mm_applies", lambda weight, *operands: on)
    monkeypatch.setattr(importlib.import_module("hf_scatter.moe.swiglu_experts"), "grouped_mm_rows_apply",
                        lambda weight, x_grouped: on)


def _experts_grads(x, w_in, w_out, idx, gates, dy, b_in=None, b_out=None):
    """The SwiGLU experts' output, then the gradients of x, w_in, w_out, the gates and any biases (float64)."""
    x, w_in, w_out, gates = (t.detach().clone().requires_grad_(True) for t in (x, w_in, w_out, gates))
    b_in, b_out = (b.detach().clone().requires_grad_(True) if b is not None else None for b in (b_in, b_out))
    y = glu_experts(x, w_in, w_out, idx, gates, gate_up_bias=b_in, down_bias=b_out)
    y.backward(dy)
    biases = [b for b in (b_in, b_out) if b is not None]
    return [y.detach().double()] + [t.grad.double() for t in (x, w_in, w_out, gates, *biases)]


# hidden > 2I: both dW operands are scattered (in place for groupXTY, copied for the library GEMM); hidden < I:
# both copied either way. Expert 0 gets no rows: its gradients must be zeros.
@pytest.mark.parametrize("hidden,intermediate", [(64, 24), (32, 48)])
@pytest.mark.parametrize("biased", [False, True])
def test_weight_gradients_through_the_library_grouped_gemm(monkeypatch, hidden, intermediate, biased):
    """The library grouped GEMM (torch._grouped_mm over grouped copies; CUTLASS on Hopper) gives the SwiGLU
    experts' output (output projection on it, mixed through the slot positions) and gradients (input gradient
    on it, summed likewise), and the ParallelLinear chain's gradients, that our kernels give, in transformers'
    [E, N, K] layout (transposed views, as patched models pass them) and in kernel layout, with an expert that
    gets no rows; with biases (GPT-OSS's experts) too, added after the mix and their gradients summed apart."""
    from hf_scatter.moe import flatten_sort_count, parallel_linear

    torch.manual_seed(0)
    E, k, T = 5, 2, 29
    x = torch.randn(T, hidden, dtype=torch.bfloat16)
    hf_in = (torch.randn(E, 2 * intermediate, hidden) * 0.2).to(torch.bfloat16)
    hf_out = (torch.randn(E, hidden, intermediate) * 0.2).to(torch.bfloat16)
    logits = torch.randn(T, E)
    logits[:, 0] = -1e9
    gates, idx = F.softmax(logits, -1).topk(k, -1)
    gates = gates.to(torch.bfloat16)
    dy = torch.randn(T, hidden, dtype=torch.bfloat16)
    biases = ((torch.randn(E, 2 * intermediate) * 0.5).to(torch.bfloat16),
              (torch.randn(E, hidden) * 0.5).to(torch.bfloat16)) if biased else ()
    for w_in, w_out in ((hf_in, hf_out), (hf_in.transpose(1, 2).contiguous().transpose(1, 2),
                                          hf_out.transpose(1, 2).contiguous().transpose(1, 2))):
        _force_library_gemm(monkeypatch, False)
        want = _experts_grads(x, w_in, w_out, idx, gates, dy, *biases)
        _force_library_gemm(monkeypatch, True)
        got = _experts_grads(x, w_in, w_out, idx, gates, dy, *biases)
        assert len(got) == 7 if biased else 5
        for g, w in zip(got, want):
            assert _rel(g, w) < 1e-2
        assert all(grad[0].abs().max() == 0 for grad in got[2:4] + got[5:])  # expert 0: no rows

    routing = flatten_sort_count(idx, E)
    weight = hf_out.transpose(1, 2)  # [E, I, hidden]
    h = torch.randn(T * k, intermediate, dtype=torch.bfloat16)
    for gated in (False, True):
        grads = []
        for on in (False, True):
            _force_library_gemm(monkeypatch, on)
            hh, w, g, *b = (t.detach().clone().requires_grad_(True) for t in (h, weight, gates, *biases[1:]))
            y = parallel_linear(hh, w, 1, *routing, bias=b[0] if b else None, gates=g if gated else None,
                                grouped_in=True)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
            grads.append([t.grad.double() for t in (hh, w, *b)])
        for g, w in zip(grads[1], grads[0]):
            assert _rel(g, w) < 1e-2
        assert all(grad[0].abs().max() == 0 for grad in grads[1][1:])


@pytest.mark.gpu
def test_library_grouped_gemm_runs_on_hopper_and_matches_group_xty(monkeypatch):
    """On a Hopper/Blackwell GPU the bf16 SwiGLU experts' weight gradients, and at a training-sized batch their
    output projection and input gradient, take the library grouped GEMM (unless HF_SCATTER_GROUPED_MM=0) and
    agree with our kernels; experts without rows get zeros."""
    from hf_scatter.kernels.library_gemm import LIBRARY_MIN_ROWS_PER_EXPERT, grouped_mm_applies, grouped_mm_rows_apply

    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("the library grouped GEMM is used on compute capability 9.x/10.x only")
    torch.manual_seed(0)
    E, k, hidden, inter = 16, 4, 512, 192
    T = LIBRARY_MIN_ROWS_PER_EXPERT * E // k + 100
    x = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
    w_in = (torch.randn(E, 2 * inter, hidden, device="cuda") * 0.05).to(torch.bfloat16)
    w_out = (torch.randn(E, hidden, inter, device="cuda") * 0.05).to(torch.bfloat16)
    assert grouped_mm_applies(w_in.transpose(1, 2), x)
    h = torch.empty(T * k, inter, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_rows_apply(w_out.transpose(1, 2), h)
    assert not grouped_mm_rows_apply(w_out.transpose(1, 2), h[:E * LIBRARY_MIN_ROWS_PER_EXPERT - 1])  # decode sizes
    # Weights the library cannot read as an operand stay on our kernels: a start off 16 bytes, no unit stride
    # in the expert matrices, more experts than the library's groups.
    shifted = torch.empty(w_out.numel() + 4, device="cuda", dtype=torch.bfloat16)[4:].view(w_out.shape)
    assert not grouped_mm_rows_apply(shifted.transpose(1, 2), h)
    assert not grouped_mm_rows_apply(w_out.transpose(1, 2)[:, ::2], h)
    assert not grouped_mm_applies(torch.empty(1024, 64, 64, device="cuda", dtype=torch.bfloat16), x)
    mixtral_sized = torch.empty(1, 14336, 4096, device="cuda", dtype=torch.bfloat16)
    assert not grouped_mm_applies(mixtral_sized, x)  # measured slower there: groupXTY keeps those
    logits = torch.randn(T, E, device="cuda")
    logits[:, :2] = -1e9  # experts 0 and 1 get no rows
    gates, idx = F.softmax(logits, -1).topk(k, -1)
    gates = gates.to(torch.bfloat16)
    dy = torch.randn(T, hidden, device="cuda", dtype=torch.bfloat16)
    biases = (torch.randn(E, 2 * inter, device="cuda").to(torch.bfloat16),
              torch.randn(E, hidden, device="cuda").to(torch.bfloat16))  # GPT-OSS's experts have them
    got = [_experts_grads(x, w_in, w_out, idx, gates, dy), _experts_grads(x, w_in, w_out, idx, gates, dy, *biases)]
    monkeypatch.setenv("HF_SCATTER_GROUPED_MM", "off")
    assert not grouped_mm_applies(w_in.transpose(1, 2), x)
    monkeypatch.setenv("HF_SCATTER_GROUPED_MM", "0")
    assert not grouped_mm_applies(w_in.transpose(1, 2), x)
    want = [_experts_grads(x, w_in, w_out, idx, gates, dy), _experts_grads(x, w_in, w_out, idx, gates, dy, *biases)]
    for got_case, want_case in zip(got, want):
        for g, w in zip(got_case, want_case):
            assert _rel(g, w) < 1e-2
        for dw in got_case[2:4] + got_case[5:]:
            assert dw[:2].abs().max() == 0 and dw[2:].flatten(1).abs().amax(1).min() > 0


@pytest.mark.parametrize("value,want", [(None, None), ("", None), ("0", False), ("off", False), ("FALSE", False),
                                        (" no ", False), ("1", True), ("on", True)])
def test_on_off_environment_variables_read_the_usual_words(monkeypatch, value, want):
    """HF_SCATTER_GROUPED_MM and HF_SCATTER_AUTOTUNE read one way: 'off' switches the library GEMM off as '0'
    does, rather than being taken for 'on'."""
    from hf_scatter.kernels.backend import env_switch

    if value is None:
        monkeypatch.delenv("HF_SCATTER_GROUPED_MM", raising=False)
    else:
        monkeypatch.setenv("HF_SCATTER_GROUPED_MM", value)
    assert env_switch("HF_SCATTER_GROUPED_MM") is want


def test_a_weight_view_is_saved_as_its_parameter_and_rebuilt_from_the_data_gathered_again():
    """DBRX reads its [E*I, H] parameters as [E, H, I] (a reshape, then a transpose): the parameter is what is
    saved, and backward rebuilds the view from whatever data it holds then, here gathered again into new
    memory at a non-zero offset, as ZeRO-3 does. A slice of a parameter is saved as itself (its base would
    keep more than the weight), and a parameter that comes back in another layout is a clear error."""
    from hf_scatter.moe.parallel_linear import saved_weight, weight_to_save

    E, I, H = 3, 5, 4
    param = torch.nn.Parameter(torch.randn(E * I, H))
    view = param.view(E, I, H).transpose(1, 2)
    kept, how = weight_to_save(view)
    assert kept is param and how is not None
    torch.testing.assert_close(saved_weight(kept, how), view, rtol=0, atol=0)
    gathered = torch.randn(7 + E * I * H)[7:].view(E * I, H)  # new memory, storage offset 7
    param.data = gathered
    torch.testing.assert_close(saved_weight(param, how), gathered.view(E, I, H).transpose(1, 2), rtol=0, atol=0)
    part = param[:, :2]
    assert weight_to_save(part) == (part, None)
    param.data = torch.randn(H, E * I).t()  # the same shape, but not contiguous
    with pytest.raises(RuntimeError, match="came back as"):
        saved_weight(param, how)
