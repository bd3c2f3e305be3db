"""``skinny_linear`` (``kernels/skinny_linear.py``) against float64 from the definition: fresh random inputs, odd
sizes, one row and a full tile of rows, K split over programs or not, outputs poisoned with NaN, the arrival
counters left at zero for the next call (a graph replays with them), the same bits on every call."""

import math

import pytest
import torch

from hf_scatter.kernels.skinny_linear import SkinnyWorkspace, skinny_linear, skinny_plan

TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _definition(x, w, b, activation):
    y = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    if activation != "none":
        y = torch.nn.functional.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    return y


def _dtypes(device):
    return [torch.float16, torch.bfloat16] if device.type == "cuda" else [torch.float16]


# (M, N, K, activation, bias): one row; odd everything; a K the plan splits in 2 and in 4 (workspace given)
CASES = [(1, 5, 7, "none", True), (40, 72, 96, "gelu", True), (17, 130, 260, "gelu_tanh", False),
         (64, 33, 1000, "none", True), (3, 40, 3000, "gelu", True), (64, 64, 128, "gelu", False)]


@pytest.mark.parametrize("M,N,K,activation,bias", CASES)
@pytest.mark.parametrize("with_workspace", [False, True])
def test_skinny_linear_equals_the_float64_definition(device, M, N, K, activation, bias, with_workspace):
    g = torch.Generator().manual_seed(M * 1000 + K)
    workspace = SkinnyWorkspace() if with_workspace else None
    for dtype in _dtypes(device):
        x = torch.randn(M, K, generator=g).to(device, dtype)
        w = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(device, dtype)
        b = torch.randn(N, generator=g).to(device, dtype) if bias else None
        want = _definition(x, w, b, activation)
        first = None
        for _ in range(2):  # the second call meets the counters the first one left
            out = torch.full((M, N), float("nan"), device=device, dtype=dtype)
            skinny_linear(x, w, b, activation, out=out, workspace=workspace)
            err = ((out.double() - want).abs() / (want.abs() + 1)).max().item()
            assert err < TOL[dtype], (dtype, err)
            assert first is None or torch.equal(out, first), "a second call gave other bits"
            first = out
        if workspace is not None:
            assert all(int(counters.abs().sum()) == 0 for _, counters in workspace._buffers.values())


def test_the_plan_splits_deep_k_and_keeps_shallow_k_whole():
    """BERT-base on 132 multiprocessors: the FFN's output projection (K 3072) in four, the others whole."""
    assert skinny_plan(40, 768, 3072, 132)[2] == 4
    for N, K in ((2304, 768), (768, 768), (3072, 768)):
        assert skinny_plan(40, N, K, 132)[2] == 1


def test_a_workspace_splits_k_and_gives_the_same_values(device):
    x = torch.randn(8, 2000, device=device, dtype=torch.float16)
    w = torch.randn(24, 2000, device=device, dtype=torch.float16) / 45
    workspace = SkinnyWorkspace()
    split = skinny_linear(x, w, workspace=workspace)
    whole = skinny_linear(x, w)
    assert workspace._buffers, "K of 2000 was not split"
    assert (split.double() - whole.double()).abs().max().item() < 2e-3 * (whole.double().abs().max().item() + 1)


def test_float32_takes_the_reference(device):
    x, w, b = torch.randn(5, 9, device=device), torch.randn(7, 9, device=device), torch.randn(7, device=device)
    got = skinny_linear(x, w, b, "gelu")
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), _definition(x, w, b, "gelu"), atol=1e-5)


@pytest.mark.parametrize("args,kwargs,message", [
    ((torch.randn(0, 4, dtype=torch.float16), torch.randn(3, 4, dtype=torch.float16)), {}, "0 rows"),
    ((torch.randn(65, 4, dtype=torch.float16), torch.randn(3, 4, dtype=torch.float16)), {}, "65 rows"),
    ((torch.randn(2, 4, dtype=torch.float16), torch.randn(3, 5, dtype=torch.float16)), {}, "weight must be [out_"),
    ((torch.randn(2, 4, dtype=torch.float16), torch.randn(3, 4)), {}, "cast them to one dtype"),
    ((torch.randn(2, 4, dtype=torch.float16), torch.randn(3, 4, dtype=torch.float16)), {"activation": "relu"},
     "activation must be one of"),
    ((torch.randn(2, 4, dtype=torch.float16), torch.randn(3, 4, dtype=torch.float16)),
     {"out": torch.empty(2, 4, dtype=torch.float16)}, "out must be (2, 3)"),
])
def test_bad_input_is_refused_with_the_fix(args, kwargs, message):
    with pytest.raises(ValueError, match=None) as error:
        skinny_linear(*args, **kwargs)
    assert message in str(error.value)


def test_dependent_launches_are_asked_for_only_inside_their_block_on_a_gpu(device):
    from hf_scatter.kernels.dependent_launch import dependent_launch, dependent_launches

    x = torch.zeros(2, 2, device=device)
    assert dependent_launch(x) == {"USE_PDL": False}
    with dependent_launches():
        inside = dependent_launch(x)
    assert dependent_launch(x) == {"USE_PDL": False}
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        assert inside == {"USE_PDL": False}


@pytest.mark.gpu
def test_a_chain_of_dependent_launches_in_a_graph_reads_each_result_after_it_is_written():
    """Each kernel of a chain reads what the one before wrote (a projection of a projection, then the add & norm
    of both): captured with dependent launches and replayed for fresh inputs, the chain gives the bits of the
    same calls launched plainly."""
    from hf_scatter.kernels.dependent_launch import dependent_launch, dependent_launches
    from hf_scatter.kernels.norms import fused_add_layer_norm

    dev, dtype = torch.device("cuda"), torch.float16
    w1, w2 = (torch.randn(768, 768, device=dev, dtype=dtype) / 28 for _ in range(2))
    gamma, beta = torch.ones(768, device=dev, dtype=dtype), torch.zeros(768, device=dev, dtype=dtype)
    workspace = SkinnyWorkspace()
    x = torch.randn(40, 768, device=dev, dtype=dtype)

    def chain():
        y1 = skinny_linear(x, w1, workspace=workspace)
        y2 = skinny_linear(y1, w2, workspace=workspace)
        return fused_add_layer_norm(y2, y1, gamma, beta, eps=1e-12, validate=False)

    with dependent_launches():
        assert dependent_launch(x)["USE_PDL"] == (torch.cuda.get_device_capability()[0] >= 9)
        chain()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, chain())

