"""Selection routers (GPT-OSS / Granite-MoE, DeepSeek-V3, DeepSeek-V2): the kernel against float64 autograd of
the HF computation and against the HF router modules themselves, ties, groups, odd sizes, bad input.

Outputs are allocated NaN-poisoned; on CPU the kernel runs under the Triton interpreter and ``path`` also
runs the torch reference (the fallback)."""

import copy

import pytest
import torch

from hf_scatter.kernels.router_select import (Selection, _scores, deepseek_v2_selection, deepseek_v3_selection,
                                              gpt_oss_selection, router_select, router_select_reference)
from test_fused_kernels import assert_close, path  # noqa: F401 - the fixture
from test_scattermoe import poisoned_empty

SELECTIONS = {
    "gpt-oss": gpt_oss_selection(),
    "v3-groups": deepseek_v3_selection(n_group=4, topk_group=2, norm_topk_prob=True, scale=2.5),
    "v3-no-norm": deepseek_v3_selection(n_group=1, topk_group=1, norm_topk_prob=False, scale=1.0),
    "v2-groups": deepseek_v2_selection(n_group=4, topk_group=3, group_limited=True, scale=1.5),
    "v2-greedy": deepseek_v2_selection(n_group=4, topk_group=3, group_limited=False, scale=1.0),
}
CASES = [(1, 8, 1), (257, 12, 3), (64, 32, 8), (33, 20, 20), (5, 256, 8)]


def _hf_order(sel: Selection, logits, indices, bias):
    """float64 autograd of the HF weights at a given choice."""
    z = logits.detach().double().requires_grad_(True)
    s = torch.sigmoid(z) if sel.score == "sigmoid" else torch.softmax(z, -1) if sel.score == "softmax" else z
    w = s.gather(1, indices)
    if sel.weights == "softmax":
        w = torch.softmax(w, -1)
    else:
        if sel.weights == "renorm":
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * sel.scale
    return z, w


def _separated_logits(T: int, E: int, sel: Selection, bias: torch.Tensor | None, generator) -> torch.Tensor:
    """Random float32 logits [T, E] whose float64 choice keys (and group scores) lie at least 1e-6 of the largest
    apart in every row: the float32 kernel then has one right choice. Near-ties (a few rows in a thousand draws)
    go either way within float32's rounding; exact ties have their own test."""
    logits = 2 * torch.randn(T, E, generator=generator)
    for _ in range(1000):
        c = _scores(logits.double(), sel.score)
        c = c if bias is None else c + bias.double()
        keys = [c]
        if sel.n_group > 1:
            grouped = c.view(T, sel.n_group, E // sel.n_group)
            keys.append(grouped.topk(2 if sel.group_score == "top2" else 1, dim=-1).values.sum(-1))
        close = torch.zeros(T, dtype=torch.bool)
        for key in keys:
            ordered = key.sort(dim=-1).values
            close |= (ordered.diff(dim=-1) <= 1e-6 * ordered.abs().amax(-1, keepdim=True)).any(-1)
        if not close.any():
            return logits
        logits[close] = 2 * torch.randn(int(close.sum()), E, generator=generator)
    raise AssertionError("no well-separated logits in 1000 draws")


@pytest.mark.parametrize("name", list(SELECTIONS))
@pytest.mark.parametrize("T,E,k", CASES, ids=[f"T{t}E{e}k{k}" for t, e, k in CASES])
def test_choice_weights_and_gradient_against_float64(device, path, name, T, E, k):
    sel = SELECTIONS[name]
    if sel.n_group > 1 and E % sel.n_group:
        sel = sel._replace(n_group=1, topk_group=1)
    g = torch.Generator().manual_seed(T * 1000 + E)  # fresh draws per case, the same in every test order
    bias = 0.3 * torch.randn(E, generator=g) if sel.score == "sigmoid" else None
    logits = _separated_logits(T, E, sel, bias, g).to(device).requires_grad_(True)
    bias = None if bias is None else bias.to(device)
    with poisoned_empty():
        w, idx = router_select(logits, k, sel, bias)
        dw = torch.randn_like(w)
        (w * dw).sum().backward()
    assert w.dtype == torch.float32 and idx.dtype == torch.int64 and w.shape == idx.shape == (T, k)
    _, want_idx = router_select_reference(logits.detach().double(), k, sel, None if bias is None else bias.double())
    assert torch.equal(idx, want_idx), "choice differs from the stable float64 order"
    z, w_ref = _hf_order(sel, logits, idx, bias)
    assert_close(w, w_ref, 1e-5, "weights")
    (w_ref * dw.double()).sum().backward()
    # measured against the scale of dw: with k = 1 and renormalisation the true gradient is ~1e-20 / s and
    # float32 leaves its rounding (different on CPU and GPU)
    atol = 1e-6 * max(sel.scale, 1.0) * dw.abs().max().item()
    torch.testing.assert_close(logits.grad.double(), z.grad, rtol=1e-5, atol=atol)


def test_gpt_oss_bf16_logits_give_bf16_weights_and_gradients(device, path):
    logits = torch.randn(77, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    with poisoned_empty():
        w, idx = router_select(logits, 4, gpt_oss_selection())
        (w.float() * torch.arange(4, device=device)).sum().backward()
    assert w.dtype == logits.grad.dtype == torch.bfloat16
    assert torch.equal(idx, torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :4])
    assert_close(w, torch.softmax(logits.detach().gather(1, idx).float(), -1), 1e-2, "weights")


def test_ties_and_negative_zero_go_to_the_lower_index(device, path):
    logits = torch.tensor([[-1.0, 0.0, -0.0, 0.5, 0.5, -3.0, float("-inf"), 0.5]], device=device)
    _, idx = router_select(logits, 6, gpt_oss_selection())
    assert idx[0].tolist() == [3, 4, 7, 1, 2, 0]
    ties = torch.randint(-2, 3, (300, 16), device=device).float()  # ties everywhere, negative logits too
    for sel in SELECTIONS.values():
        _, idx = router_select(ties, 5, sel)
        assert torch.equal(idx, router_select_reference(ties, 5, sel, None)[1]), sel


def test_groups_limit_the_choice(device, path):
    """Two groups of four: group 1 holds the two best scores but group 0 the best pair, so k=3 with one
    group kept takes group 0's three best even though expert 4 alone beats them all."""
    logits = torch.tensor([[1.0, 1.0, 0.9, -5.0, 3.0, -5.0, -5.0, -5.0]], device=device)
    sel = deepseek_v3_selection(n_group=2, topk_group=1, norm_topk_prob=False, scale=1.0)
    _, idx = router_select(logits, 3, sel)
    assert sorted(idx[0].tolist()) == [0, 1, 2]
    _, idx = router_select(logits, 5, sel)  # more than the kept group holds: the rest at -inf, lowest first
    assert idx[0].tolist() == [0, 1, 2, 3, 4]


def _hf_router(family: str, E: int, k: int, hidden: int = 32):
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        config = DeepseekV3Config(hidden_size=hidden, n_routed_experts=E, num_experts_per_tok=k, n_group=4,
                                  topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
        router = DeepseekV3TopkRouter(config)
        router.e_score_correction_bias.normal_(0, 0.05)
        return router, deepseek_v3_selection(4, 2, True, 2.5)
    if family.startswith("deepseek_v2"):
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        greedy = family.endswith("greedy")
        config = DeepseekV2Config(hidden_size=hidden, n_routed_experts=E, num_experts_per_tok=k, n_group=4,
                                  topk_group=2, routed_scaling_factor=1.5,
                                  topk_method="greedy" if greedy else "group_limited_greedy")
        return DeepseekV2TopkRouter(config), deepseek_v2_selection(4, 2, not greedy, 1.5)
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(GptOssConfig(hidden_size=hidden, num_local_experts=E, num_experts_per_tok=k))
    router.bias.data.normal_()
    return router, gpt_oss_selection()


def _clear_choices(router, sel: Selection, bias, k: int, rows: int) -> torch.Tensor:
    """``rows`` inputs [rows, hidden] whose float64 choice keys have no near-tie at the k-th choice or the kept
    groups' edge (relative gap above 1e-5): a near-tie within float32's rounding goes either way on another CPU's
    vector code, in the HF router as in ours (seed 0 had a gap of 2e-9 in DeepSeek-V2's rows)."""
    x = torch.randn(4 * rows, router.weight.shape[1])
    with torch.no_grad():  # the router's own logits (GPT-OSS's bias included), in float64
        c = _scores(copy.deepcopy(router).cpu().double()(x.double())[0], sel.score)
    c = c if bias is None else c + bias.double().cpu()
    top = c.sort(-1, descending=True).values
    clear = (top[:, k - 1] - top[:, k]) > 1e-5 * top.abs().amax(-1)
    if sel.n_group > 1:
        groups = c.view(len(x), sel.n_group, -1).topk(2 if sel.group_score == "top2" else 1, -1).values.sum(-1)
        ranked = groups.sort(-1, descending=True).values
        edge = ranked[:, sel.topk_group - 1] - ranked[:, sel.topk_group]
        clear &= edge > 1e-5 * ranked.abs().amax(-1)
    assert int(clear.sum()) >= rows, "too few inputs without near-ties"
    return x[clear][:rows]


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "deepseek_v2_groups", "deepseek_v2_greedy"])
def test_matches_the_hf_router_modules(device, path, family):
    """Same experts (as sets: the HF routers ask topk for sorted=False) and the same weights per expert."""
    torch.manual_seed(0)
    router, sel = _hf_router(family, E=32, k=6)
    with torch.no_grad():
        router.weight.normal_()
    router = router.to(device)
    bias = getattr(router, "e_score_correction_bias", None)  # DeepSeek-V3's, on the device
    x = _clear_choices(router, sel, bias, k=6, rows=200).to(device)
    logits, want_w, want_idx = router(x)
    got_w, got_idx = router_select(logits, 6, sel, bias, out_dtype=want_w.dtype)
    order_got, order_want = got_idx.argsort(-1), want_idx.argsort(-1)
    assert torch.equal(got_idx.gather(1, order_got), want_idx.gather(1, order_want))
    torch.testing.assert_close(got_w.gather(1, order_got), want_w.gather(1, order_want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("call,match", [
    (lambda: router_select(torch.randn(4, 6), 2, Selection(score="tanh")), "score must be one of"),
    (lambda: router_select(torch.randn(4, 6), 2, Selection(score="sigmoid")), "weights='softmax'.*score='logits'"),
    (lambda: router_select(torch.randn(4, 6), 2, deepseek_v3_selection(4, 2, True, 1.0)),
     "n_group must be a positive int dividing the 6 experts"),
    (lambda: router_select(torch.randn(4, 8), 2, deepseek_v3_selection(2, 3, True, 1.0)),
     r"topk_group must be in \[1, n_group=2\]"),
    (lambda: router_select(torch.randn(4, 4), 2, deepseek_v3_selection(4, 2, True, 1.0)),
     "at least 2 experts per group"),
    (lambda: router_select(torch.randn(4, 6), 7, gpt_oss_selection()), r"top_k must be an int in \[1, 6\]"),
    (lambda: router_select(torch.randn(4, 6), 2, deepseek_v3_selection(1, 1, True, 1.0), torch.randn(5)),
     r"bias must be \[6\]"),
    (lambda: router_select(torch.randn(2, 4, 6), 2, gpt_oss_selection()), r"logits must be \[tokens, experts\]"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
