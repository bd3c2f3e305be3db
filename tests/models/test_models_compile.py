"""Patched models of every MoE family under torch.compile with fullgraph=True: the logits and every gradient equal
eager's (a file of its own so that its compile time spreads over the test workers apart from test_models.py)."""

import copy

import pytest
import torch

from test_models import FAMILIES, LINEAR_ATTENTION, _assert_same_grads, _ids, _rel, vanilla_and_patched


# Qwen3-Next's and Qwen3.5-MoE's gated delta net (transformers' torch path) does not survive a fullgraph-compiled
# backward on the CPU: vanilla transformers with its grouped_mm experts fails it the same way (aot_eager: "view size is
# not compatible"). On CUDA (inductor) the patched models compile and match eager; the test runs there.
# Not run on the CPU (8 s a family for a known failure of transformers' code); the reason shows in the report.
_COMPILE_FAMILIES = [pytest.param(f, marks=pytest.mark.xfail(
    not torch.cuda.is_available(), reason="transformers' gated-delta-net torch path under a compiled CPU backward", run=False))
    if f in LINEAR_ATTENTION else f for f in FAMILIES]


@pytest.mark.kernel_bodies("reference")
@pytest.mark.parametrize("family", _COMPILE_FAMILIES)
def test_torch_compile_fullgraph_forward_and_backward(family, device):
    # one MoE layer: the compiled graph repeats each layer's code (the hybrid stacks keep a layer of each kind)
    _, patched = vanilla_and_patched(family, device, **({} if family in LINEAR_ATTENTION else {"layers": 1}))
    reference = copy.deepcopy(patched)
    ids = _ids(device)
    backend = "aot_eager" if device.type == "cpu" else "inductor"
    compiled = torch.compile(patched, fullgraph=True, backend=backend)
    got = compiled(ids, labels=ids)
    want = reference(ids, labels=ids)
    assert _rel(got.logits, want.logits) < 1e-5
    got.loss.backward()
    want.loss.backward()
    _assert_same_grads(reference, patched, tol=1e-4)
    torch._dynamo.reset()
