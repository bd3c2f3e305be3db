"""ScatterMoE core: routing, scatter2scatter / groupXTY kernels and ParallelLinear forward + backward.

Every check draws fresh random inputs, compares with a float64 per-slot reference by relative norm error
(fp32 1e-5, fp16/bf16 1e-2), and runs with uninitialised memory filled with NaN so unwritten rows fail.
"""

import contextlib

import pytest
import torch

from hf_scatter.kernels.gating import gate_grad, gate_mix
from hf_scatter.kernels.groupxty import group_sum, groupXTY
from hf_scatter.kernels.scatter2scatter import scatter2scatter
from hf_scatter.moe import flatten_sort_count, parallel_linear
from moe_reference import reference_parallel_linear

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty & co. return NaN-filled memory inside this block (deterministic mode's fill)."""
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def rel_err(out, ref):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), "non-finite values (unwritten rows?)"
    denom = ref.double().norm().clamp_min(1e-12)
    return ((out.double() - ref.double()).norm() / denom).item()


def routing_case(T, k, E, device, pattern="random"):
    if pattern == "random":
        idx = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)]) if k <= E else None
    elif pattern == "one-expert":  # every token's first choice is expert E-1 (others random, distinct)
        idx = torch.stack([torch.cat([torch.tensor([E - 1], device=device),
                                      torch.randperm(E - 1, device=device)[:k - 1]]) for _ in range(T)])
    elif pattern == "empty-expert":  # expert 0 never chosen
        idx = torch.stack([1 + torch.randperm(E - 1, device=device)[:k] for _ in range(T)])
    return idx


# ------------------------------------------------------------------------------------------ routing
def test_flatten_sort_count_contract(device):
    idx = torch.tensor([[2, 0], [0, 2], [1, 0]], device=device)
    se, ss, off = flatten_sort_count(idx, 4)
    assert se.tolist() == [0, 0, 0, 1, 2, 2]
    assert ss.tolist() == [1, 2, 5, 4, 0, 3]  # stable: slots of expert 0 in increasing order
    assert off.tolist() == [3, 4, 6, 6]


_SORT_BATCHES = [(6, 4, "random"), (1, 1, "random"), (512, 128, "random"), (128, 8, "random"), (37, 5, "one-expert"),
                 (2048, 16, "random"), (64, 256, "random"), (300, 64, "half-empty"), (4096, 128, "random"),
                 (200, 512, "random")]


# Both id dtypes at every batch up to 512 slots; the two largest (the interpreter's sort of 2-4k keys: 46 s of
# the suite for the int32 runs alone) with the int64 ids a router's topk gives. The dtype only changes the load.
@pytest.mark.parametrize("slots,experts,pattern,dtype", [
    (*batch, dtype) for batch in _SORT_BATCHES for dtype in (torch.int64, torch.int32)
    if dtype == torch.int64 or batch[0] <= 512])
def test_small_batch_sort_kernel_equals_torch_sort_and_hands_over_its_tile_table(device, slots, experts, pattern,
                                                                                  dtype, monkeypatch):
    """The one-launch routing sort of small batches: the same stable order, offsets and dtypes as torch's sort
    (empty experts, every slot on one expert, E = 256 included), and the expert GEMMs reuse the tile table it
    made instead of launching their own."""
    from hf_scatter.kernels import scatter2scatter as s2s
    from hf_scatter.kernels import sort_slots as kernel
    from hf_scatter.kernels.sort_slots import fits_one_program, sort_slots, sort_slots_reference

    monkeypatch.setattr(kernel, "INTERPRET_KERNEL", True)  # on the CPU too: the kernel, not torch's sort
    assert fits_one_program(slots, experts)
    flat = torch.randint(0, experts, (slots,), device=device, dtype=dtype)
    if pattern == "one-expert":
        flat.fill_(experts - 1)
    elif pattern == "half-empty":
        flat = flat // 2 * 2  # odd experts get no slots
    got, want = sort_slots(flat, experts), sort_slots_reference(flat, experts)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    block_m = s2s.tile_rows(slots, experts)
    made = []
    real = s2s.expert_tiles
    s2s.expert_tiles = lambda *a: made.append(a) or real(*a)
    try:
        tile_expert, tile_row = s2s._tiles_of(got[2], block_m, slots)
    finally:
        s2s.expert_tiles = real
    assert made == [], "the sort's own tile table is used"
    ref_expert, ref_row = s2s.expert_tiles_reference(want[2], block_m, slots)
    assert torch.equal(tile_expert.cpu(), ref_expert.cpu()) and torch.equal(tile_row.cpu(), ref_row.cpu())


def test_a_routing_with_a_skip_bin_reuses_the_sorts_tile_table(device, monkeypatch):
    """Expert parallelism's skip bin (one routing bin more than the weight has experts): the expert GEMM finds
    the tile table the small-batch routing sort made instead of launching its own. 24 slots over 5 experts
    and a skip bin: 4.8 rows per expert but 4 per bin, on either side of a tile-size step."""
    from hf_scatter.kernels import scatter2scatter as s2s
    from hf_scatter.kernels.backend import use_triton
    from hf_scatter.moe.routing import flatten_sort_count

    from hf_scatter.kernels import sort_slots

    monkeypatch.setattr(sort_slots, "INTERPRET_KERNEL", True)
    E, T, k, d = 5, 12, 2, 16
    idx = torch.randint(0, E + 1, (T, k), generator=torch.Generator().manual_seed(0)).to(device)
    routing = flatten_sort_count(idx, E + 1, validate=False)
    if not use_triton(routing[2], "expert_tiles"):
        pytest.skip("the tile table is the Triton kernels' (the torch reference makes none)")
    assert s2s.tile_rows(T * k, E) != s2s.tile_rows(T * k, E + 1)
    made = []
    real = s2s.expert_tiles
    s2s.expert_tiles = lambda *a: made.append(a) or real(*a)
    try:
        s2s.scatter2scatter(torch.randn(T, d, device=device), torch.randn(E, d, 8, device=device), *routing, k)
    finally:
        s2s.expert_tiles = real
    assert made == [], "the sort's own tile table is used"


def test_large_batches_keep_torch_sort(device):
    from hf_scatter.kernels.sort_slots import fits_one_program

    assert fits_one_program(512, 128) and fits_one_program(4096, 16)
    assert not fits_one_program(16384 * 8, 128) and not fits_one_program(4097, 8) and not fits_one_program(64, 1024)
    idx = torch.randint(0, 128, (1024, 8), device=device)
    se, ss, off = flatten_sort_count(idx, 128)
    assert "_hf_scatter_tiles" not in off.__dict__
    assert torch.equal(se, idx.reshape(-1)[ss]) and torch.equal(se, se.sort().values)


def test_flatten_sort_count_rejects_out_of_range(device):
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        flatten_sort_count(torch.tensor([[0, 4]], device=device), 4)
    with pytest.raises(ValueError, match="integer tensor"):
        flatten_sort_count(torch.zeros(2, 2, device=device), 4)


# ------------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("x_grouped", [False, True])
@pytest.mark.parametrize("y_grouped", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scatter2scatter_all_modes_poisoned_out(device, x_grouped, y_grouped, with_bias):
    T, k, E, K, N = 29, 3, 5, 100, 70
    idx = routing_case(T, k, E, device)
    se, ss, off = flatten_sort_count(idx, E)
    w = torch.randn(E, N, K, device=device).transpose(1, 2)  # transposed HF layout, read in place
    b = torch.randn(E, N, device=device) if with_bias else None
    x_tok = torch.randn(T, K, device=device)
    x = x_tok[ss // k] if x_grouped else x_tok
    out = torch.full((T * k, N), float("nan"), device=device)
    scatter2scatter(x, w, se, ss, off, fan_out=1 if x_grouped else k, x_grouped=x_grouped, y_grouped=y_grouped,
                    bias=b, out=out)
    ref = reference_parallel_linear(x.double(), w.double(), 1 if x_grouped else k, idx, None if b is None else
                                    b.double(), grouped_in=x_grouped, grouped_out=y_grouped)
    assert rel_err(out, ref) < 1e-5


def _assert_per_expert_xty(dw, db, x_grouped, dy_grouped, expert_offsets):
    """dW[e] = X_e^T dY_e and db[e] = sum dY_e over each expert's grouped rows, in float64."""
    start = 0
    for e, end in enumerate(expert_offsets.tolist()):
        ref_w = x_grouped[start:end].double().t() @ dy_grouped[start:end].double()
        assert torch.allclose(dw[e].double(), ref_w, atol=1e-4, rtol=1e-5), e
        assert torch.allclose(db[e].double(), dy_grouped[start:end].double().sum(0), atol=1e-4), e
        start = end


def test_groupxty_poisoned_and_empty_expert(device):
    E, K, N = 4, 33, 600
    idx = routing_case(40, 1, E, device, "empty-expert")
    se, ss, off = flatten_sort_count(idx, E)
    x, dy = torch.randn(40, K, device=device), torch.randn(40, N, device=device)
    dw = torch.full((E, K, N), float("nan"), device=device)
    db = torch.full((E, N), float("nan"), device=device)
    groupXTY(x, dy, off, dw, db)
    _assert_per_expert_xty(dw, db, x, dy, off)
    assert torch.count_nonzero(dw[0]) == 0 and torch.count_nonzero(db[0]) == 0  # expert 0 had no rows


@pytest.mark.parametrize("x_fan_out,dy_fan_out", [(3, 3), (3, 0), (0, 1), (0, 3)])
def test_groupxty_reads_scattered_operands_in_place(device, x_fan_out, dy_fan_out):
    """Backward may read X and dY where they lie (row idx[i] // fan_out): the result must equal groupXTY over
    explicitly grouped copies."""
    T, k, E, K, N = 23, 3, 5, 33, 70
    idx = routing_case(T, k, E, device, "empty-expert")
    se, ss, off = flatten_sort_count(idx, E)
    M = T * k
    x = torch.randn(M // x_fan_out if x_fan_out else M, K, device=device)
    dy = torch.randn(M // dy_fan_out if dy_fan_out else M, N, device=device)
    x_g = x[ss // x_fan_out] if x_fan_out else x
    dy_g = dy[ss // dy_fan_out] if dy_fan_out else dy
    dw = torch.full((E, K, N), float("nan"), device=device)
    db = torch.full((E, N), float("nan"), device=device)
    groupXTY(x, dy, off, dw, db, sorted_scattered_idxs=ss, x_fan_out=x_fan_out, dy_fan_out=dy_fan_out)
    _assert_per_expert_xty(dw, db, x_g, dy_g, off)
    with pytest.raises(ValueError, match="need sorted_scattered_idxs"):
        groupXTY(x, dy, off, x_fan_out=x_fan_out or 1)


@pytest.mark.parametrize("K,N", [(64, 128), (33, 70)])
@pytest.mark.parametrize("fan_out", [0, 2])
def test_groupxty_full_row_blocks_and_a_partial_one(device, K, N, fan_out):
    """Experts of about 100 rows: several whole row blocks and a partial last one, with K and N that divide the
    tile evenly and that do not; grouped and scattered operands."""
    T, k, E = 150, 2, 3
    idx = routing_case(T, k, E, device, "random")
    se, ss, off = flatten_sort_count(idx, E)
    M = T * k
    x = torch.randn(M // fan_out if fan_out else M, K, device=device)
    dy = torch.randn(M // fan_out if fan_out else M, N, device=device)
    x_g, dy_g = (x[ss // fan_out], dy[ss // fan_out]) if fan_out else (x, dy)
    dw = torch.full((E, K, N), float("nan"), device=device)
    db = torch.full((E, N), float("nan"), device=device)
    groupXTY(x, dy, off, dw, db, sorted_scattered_idxs=ss if fan_out else None, x_fan_out=fan_out, dy_fan_out=fan_out)
    assert min(torch.diff(off, prepend=off.new_zeros(1)).tolist()) > 64  # whole blocks at any block height up to 64
    _assert_per_expert_xty(dw, db, x_g, dy_g, off)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [70, 200])
def test_group_sum_is_each_experts_row_sum(device, dtype, N):
    """The bias gradient beside the library weight gradient: each expert's grouped rows summed (float64
    reference; an expert without rows gets zeros, an expert of over 100 rows spans several row blocks, N spans
    one partial column block or several), into a fresh buffer; a skip bin past the experts is left out."""
    T, k, E = 150, 2, 4
    idx = routing_case(T, k, E, device, "empty-expert")
    idx[: T // 2] = torch.tensor([2, 3], device=device)  # expert 2 and 3 get more than 75 rows each
    _, _, off = flatten_sort_count(idx, E)
    dy = torch.randn(T * k, N, device=device).to(dtype)
    db = group_sum(dy, off, out=torch.full((E, N), float("nan"), device=device, dtype=dtype))
    # fp32 sums: a bf16 result is off by its own rounding, under one bf16 unit (2^-7 relative: the interpreter
    # truncates where a GPU rounds to nearest); an fp32 one by the summation order
    rtol = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    start = 0
    for e, end in enumerate(off.tolist()):
        want = dy[start:end].double().sum(0)
        assert torch.allclose(db[e].double(), want, atol=1e-6 * (end - start + 1), rtol=rtol), e
        start = end
    counts = torch.diff(off, prepend=off.new_zeros(1))
    assert counts.min() == 0 and counts.max() > 100 and torch.count_nonzero(db[counts == 0]) == 0
    assert torch.equal(group_sum(dy, off, experts=E - 1), db[: E - 1])
    assert group_sum(dy, off).shape == (E, N)
    with pytest.raises(ValueError, match="experts must be between 0 and the 4 bins"):
        group_sum(dy, off, experts=E + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_mix_and_gate_grad_against_float64(device, dtype):
    T, k, N = 37, 3, 300
    y = torch.randn(T * k, N, device=device).to(dtype)
    g = torch.rand(T, k, device=device)
    out = torch.full((T, N), float("nan"), device=device, dtype=dtype)
    gate_mix(y, g, out=out)
    ref = (y.double().view(T, k, N) * g.double()[..., None]).sum(1)
    assert rel_err(out, ref) < TOL[dtype] / 2
    x = torch.randn(T, N, device=device).to(dtype)
    dots = gate_grad(y, x, fan_out=k)  # slot order: dx row s against x row s // k
    assert rel_err(dots, (y.double().view(T, k, N) * x.double()[:, None]).sum(-1).view(-1)) < TOL[dtype] / 2
    coeff = torch.rand(T * k, device=device)
    dx = y.clone()
    scaled = torch.full_like(y, float("nan"))
    dots = gate_grad(dx, y, fan_out=1, coeff=coeff, x_scaled_out=scaled)  # dots before the in-place scaling
    assert rel_err(dots, (y.double() ** 2).sum(1)) < TOL[dtype] / 2
    assert rel_err(dx, y.double() * coeff.double()[:, None]) < TOL[dtype] / 2
    assert rel_err(scaled, y.double() * coeff.double()[:, None]) < TOL[dtype] / 2
    with pytest.raises(ValueError, match="y_slots must be"):
        gate_mix(y[:-1], g)


def test_gate_mix_with_the_gpu_s_one_row_tiles(device, monkeypatch):
    """The GPU's tiles (one token row a program, 512 columns, the k slot rows unrolled) give the same mix as the
    interpreter's 16-row tiles, at sizes that leave partial column blocks, poisoned output included."""
    from hf_scatter.kernels import gating

    monkeypatch.setattr(gating, "triton_interpreted", lambda: False)
    for T, k, N in ((5, 8, 700), (3, 1, 40)):
        y = torch.randn(T * k, N, device=device).to(torch.bfloat16)
        g = torch.rand(T, k, device=device)
        out = torch.full((T, N), float("nan"), device=device, dtype=torch.bfloat16)
        gate_mix(y, g, out=out)
        assert rel_err(out, (y.double().view(T, k, N) * g.double()[..., None]).sum(1)) < TOL[torch.bfloat16] / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_mix_reads_expert_ordered_rows_through_slot_positions(device, dtype):
    """Rows an expert GEMM wrote in expert order (the library grouped GEMM's output) mix per token through the
    slot positions, weighted or as the plain k-sum of an input gradient, equal to mixing them in slot order."""
    from hf_scatter.kernels.gating import gate_mix_unchecked
    from hf_scatter.moe import flatten_sort_count
    from hf_scatter.moe.routing import slot_positions

    T, k, E, N = 41, 3, 6, 136
    idx = torch.rand(T, E, device=device).topk(k, -1).indices
    _, sorted_scattered, _ = flatten_sort_count(idx, E)
    positions = slot_positions(sorted_scattered)
    assert torch.equal(sorted_scattered[positions], torch.arange(T * k, device=device))
    y_slots = torch.randn(T * k, N, device=device).to(dtype)
    y_grouped = y_slots[sorted_scattered]  # row i holds slot sorted_scattered[i]
    g = torch.rand(T, k, device=device)
    out = torch.full((T, N), float("nan"), device=device, dtype=dtype)
    gate_mix(y_grouped, g, out=out, slot_rows=positions)
    assert rel_err(out, (y_slots.double().view(T, k, N) * g.double()[..., None]).sum(1)) < TOL[dtype] / 2
    summed = gate_mix_unchecked(y_grouped, None, slot_rows=positions, k=k)
    assert rel_err(summed, y_slots.double().view(T, k, N).sum(1)) < TOL[dtype] / 2
    with pytest.raises(ValueError, match="slot_rows must have"):
        gate_mix(y_grouped, g, slot_rows=positions[:-1])


@pytest.mark.parametrize("counts,block_m", [([5, 0, 17, 1], 4), ([0, 0, 9], 16), ([3], 2), ([40] * 1, 64),
                                             ([i % 7 for i in range(256)], 16)])
def test_expert_tiles_kernel_matches_its_reference(device, counts, block_m):
    """Every program's (expert, first row): the kernel against the torch form, empty experts and E = 256 included."""
    from hf_scatter.kernels.scatter2scatter import expert_tiles, expert_tiles_reference

    offsets = torch.tensor(counts, device=device).cumsum(0)
    rows = int(offsets[-1])
    got_e, got_r = expert_tiles(offsets, block_m, rows)
    want_e, want_r = expert_tiles_reference(offsets, block_m, rows)
    assert got_e.tolist() == want_e.tolist()
    live = want_e < len(counts)  # rows of programs past the last tile are never read
    assert got_r[live].tolist() == want_r[live].tolist()
    assert int(live.sum()) == sum(-(-c // block_m) for c in counts)


def test_tuned_config_is_reused_without_the_autotuner(monkeypatch):
    """After Triton's autotuner picked a config for a launch key, later launches use it directly."""
    from hf_scatter.kernels import backend

    calls = []

    class Config:
        kwargs, num_warps, num_stages = {"BLOCK_N": 64}, 4, 3

    class Tuned:
        best_config = None

        def __getitem__(self, grid):
            def run(*args, **meta):
                calls.append(("tuned", grid({"BLOCK_N": 64})))
                self.best_config = Config()
            return run

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(("direct", grid, meta["BLOCK_N"], meta["num_stages"]))

    monkeypatch.setattr(backend, "triton_interpreted", lambda: False)
    monkeypatch.setattr(backend, "autotune_enabled", lambda: True)
    tuned, kernel, grid = Tuned(), Kernel(), lambda cfg: (128 // cfg["BLOCK_N"],)
    for _ in range(3):
        backend.launch(kernel, tuned, [], {}, grid, (), {}, {}, tune_key=("k", 1))
    backend.launch(kernel, tuned, [], {}, grid, (), {}, {}, tune_key=("k", 2))  # a new key is tuned again
    assert calls == [("tuned", (2,)), ("direct", (2,), 64, 3), ("direct", (2,), 64, 3), ("tuned", (2,))]


# ------------------------------------------------------------------------------------ ParallelLinear
CASES = [  # T, k, E, d_in, d_out, routing pattern
    (13, 2, 4, 100, 300, "random"),  # several column tiles, the last one partial
    (1, 2, 4, 40, 24, "random"),
    (17, 3, 5, 72, 100, "empty-expert"),
    (21, 2, 6, 48, 40, "one-expert"),
    (9, 1, 3, 64, 33, "random"),
    (7, 4, 4, 32, 48, "random"),  # k = E
]


def _run_case(device, dtype, T, k, E, d_in, d_out, pattern, grouped_in, grouped_out, with_bias, with_gates,
              fan_out=None, gate_width=None, x_grad=True):
    """T tokens routed to k experts each; the layer reads input row s // fan_out for slot s (default k) and,
    with gates, mixes groups of gate_width consecutive slots (default k)."""
    fan_out, gate_width = fan_out or k, gate_width or k
    idx = routing_case(T, k, E, device, pattern)
    se, ss, off = flatten_sort_count(idx, E)
    M = T * k
    w_hf = (torch.randn(E, d_out, d_in, device=device, dtype=dtype) / d_in ** 0.5).requires_grad_(True)
    weight = w_hf.transpose(1, 2)  # a view of the HF-layout parameter
    bias = torch.randn(E, d_out, device=device, dtype=dtype, requires_grad=True) if with_bias else None
    gates = torch.rand(M // gate_width, gate_width, device=device, dtype=torch.float32, requires_grad=True) \
        if with_gates else None
    x_tok = torch.randn(M // fan_out, d_in, device=device, dtype=dtype)
    x = (x_tok[ss // fan_out] if grouped_in else x_tok).detach().requires_grad_(x_grad)
    with poisoned_empty():
        y = parallel_linear(x, weight, fan_out, se, ss, off, bias=bias, gates=gates, grouped_in=grouped_in,
                            grouped_out=grouped_out)
        dy = torch.randn_like(y)
        y.backward(dy)

    leaves = [t for t in (x, w_hf, bias, gates) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in leaves]
    rx, rw = ref_leaves[0], ref_leaves[1]
    rb = ref_leaves[2] if with_bias else None
    rg = ref_leaves[-1] if with_gates else None
    ref = reference_parallel_linear(rx, rw.transpose(1, 2), fan_out, idx, rb, rg, grouped_in, grouped_out)
    ref.backward(dy.double())
    tol = TOL[dtype]
    assert rel_err(y, ref) < tol, "forward"
    names = ["dX", "dW"] + (["db"] if with_bias else []) + (["d_gates"] if with_gates else [])
    for name, got, want in zip(names, leaves, ref_leaves):
        if not got.requires_grad:
            assert got.grad is None, name
            continue
        assert got.grad is not None, name
        assert got.grad.shape == got.shape, name
        assert rel_err(got.grad, want.grad) < tol, name


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}k{c[1]}E{c[2]}-{c[3]}x{c[4]}-{c[5]}")
@pytest.mark.parametrize("mode", ["scatter->scatter", "scatter->group", "group->scatter", "group->group"])
def test_parallel_linear_modes_fp32(device, case, mode):
    grouped_in, grouped_out = mode.startswith("group"), mode.endswith("group")
    _run_case(device, torch.float32, *case, grouped_in, grouped_out, with_bias=True, with_gates=False)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}k{c[1]}E{c[2]}-{c[3]}x{c[4]}-{c[5]}")
@pytest.mark.parametrize("grouped_in", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_parallel_linear_gates_fp32(device, case, grouped_in, with_bias):
    _run_case(device, torch.float32, *case, grouped_in, False, with_bias=with_bias, with_gates=True)


GATE_WIDTH_CASES = [  # T, routed slots per token, E, d_in, d_out, pattern, input fan-out k, gate width j, grouped_in
    (13, 3, 5, 40, 33, "empty-expert", 1, 3, False),  # MoA's O projection: one input row per slot, [T, k_moa] gates
    (11, 2, 4, 24, 70, "random", 1, 2, True),  # grouped input with d_out > d_in: dY read in place for dW
    (14, 2, 4, 33, 24, "one-expert", 2, 4, False),  # j > k > 1: dX mixes each token's k slots
    (9, 3, 4, 40, 24, "random", 3, 1, False),  # j = 1: each slot scaled by its own gate, [T*k, d_out] out
    (10, 3, 4, 24, 40, "empty-expert", 3, 1, True),
]


@pytest.mark.parametrize("case", GATE_WIDTH_CASES, ids=lambda c: f"T{c[0]}x{c[1]}E{c[2]}-k{c[6]}j{c[7]}"
                                                                 f"{'-grouped' if c[8] else ''}-{c[5]}")
@pytest.mark.parametrize("with_bias", [False, True])
def test_parallel_linear_gate_width_independent_of_fan_out(device, case, with_bias):
    """Algorithm 1: gates [S, j] with S*j = T*k, whatever the input fan-out k."""
    *shape, fan_out, gate_width, grouped_in = case
    _run_case(device, torch.float32, *shape, grouped_in, False, with_bias=with_bias, with_gates=True,
              fan_out=fan_out, gate_width=gate_width)


@pytest.mark.parametrize("gate_width", [3, 1])
def test_parallel_linear_gate_width_without_input_grad(device, gate_width):
    """A constant input (no dX): the gate and weight gradients alone, scattered input read once per slot."""
    _run_case(device, torch.float32, 12, 3, 4, 36, 28, "empty-expert", False, False, with_bias=True, with_gates=True,
              fan_out=1, gate_width=gate_width, x_grad=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["scatter->group", "group->scatter+gates", "scatter->scatter+gates"])
def test_parallel_linear_half_precision(device, dtype, mode):
    grouped_in = mode.startswith("group")
    _run_case(device, dtype, 19, 2, 4, 100, 72, "random", grouped_in, mode.endswith("group"), with_bias=True,
              with_gates=mode.endswith("gates"))


@pytest.mark.parametrize("d_in,d_out", [(40, 24), (24, 40)])  # dY copied / dY read in place for dW
def test_parallel_linear_with_constant_gates(device, d_in, d_out):
    """Gates that need no gradient (a frozen router): dX and dW must still carry them."""
    T, k, E = 15, 2, 4
    idx = routing_case(T, k, E, device)
    se, ss, off = flatten_sort_count(idx, E)
    w = torch.randn(E, d_in, d_out, device=device, requires_grad=True)
    gates = torch.rand(T, k, device=device)
    x = torch.randn(T * k, d_in, device=device)[ss].contiguous().requires_grad_(True)
    y = parallel_linear(x, w, k, se, ss, off, gates=gates, grouped_in=True)
    dy = torch.randn_like(y)
    y.backward(dy)
    rx, rw = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    reference_parallel_linear(rx, rw, k, idx, None, gates.double(), True, False).backward(dy.double())
    assert rel_err(x.grad, rx.grad) < 1e-5 and rel_err(w.grad, rw.grad) < 1e-5


def test_parallel_linear_noncontiguous_input(device):
    T, k, E = 11, 2, 3
    idx = routing_case(T, k, E, device)
    se, ss, off = flatten_sort_count(idx, E)
    x = torch.randn(T, 80, device=device)[:, ::2]  # strided columns
    w = torch.randn(E, 40, 50, device=device)[:, :, 5:45].transpose(1, 2)  # sliced then transposed
    y = parallel_linear(x, w, k, se, ss, off)
    assert rel_err(y, reference_parallel_linear(x.double(), w.double(), k, idx)) < 1e-5


def test_weight_grad_keeps_hf_layout(device):
    E, T, k = 4, 10, 2
    idx = routing_case(T, k, E, device)
    w_hf = torch.randn(E, 24, 16, device=device, requires_grad=True)
    y = parallel_linear(torch.randn(T, 16, device=device), w_hf.transpose(1, 2), k, *flatten_sort_count(idx, E))
    y.sum().backward()
    assert w_hf.grad.is_contiguous(), "dW should arrive in the parameter's own layout (no copy in AccumulateGrad)"


# ------------------------------------------------------------------------------------ validation
def _routing(device):
    return flatten_sort_count(torch.tensor([[0, 1], [1, 2], [2, 0]], device=device), 3)


@pytest.mark.parametrize("call,match", [
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d), torch.randn(3, 9, 4, device=d), 2, *r), "d_in=9"),
    (lambda r, d: parallel_linear(torch.randn(4, 8, device=d), torch.randn(3, 8, 4, device=d), 2, *r), "rows"),
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d), torch.randn(3, 8, 4, device=d).half(), 2, *r),
     "dtype"),
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d), torch.randn(3, 8, 4, device=d), 4, *r),
     "multiple of k"),
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d), torch.randn(3, 8, 4, device=d), 2, *r,
                                  gates=torch.rand(3, 3, device=d)),
     r"gates must be \[S, j\] with S\*j = 6 routed slots .*\[T, k\] = \(3, 2\); got \(3, 3\)"),
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d), torch.randn(3, 8, 4, device=d), 2, *r,
                                  gates=torch.rand(6, device=d)), r"gates must be \[S, j\].*got \(6,\)"),
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d), torch.randn(3, 8, 4, device=d), 2, *r,
                                  gates=torch.ones(2, 3, device=d, dtype=torch.long)), "floating-point"),
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d), torch.randn(3, 8, 4, device=d), 2, *r,
                                  gates=torch.rand(3, 2, device=d), grouped_out=True), "grouped_out=False"),
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d), torch.randn(4, 8, 4, device=d), 2, *r),
     r"expert_offsets must have one end per expert \(E=4\), or one more for a bin of routes to skip; got 3"),
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d), torch.randn(3, 8, 4, device=d), 2, *r,
                                  bias=torch.randn(3, 5, device=d)), "bias must be"),
    (lambda r, d: parallel_linear(torch.randn(3, 8, device=d).long(), torch.randn(3, 8, 4, device=d), 2, *r),
     "float32, float16 or bfloat16"),
])
def test_bad_input_is_a_clear_error(device, call, match):
    with pytest.raises(ValueError, match=match):
        call(_routing(device), device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autotuned_gpu_path(monkeypatch, device, dtype):
    monkeypatch.setenv("HF_SCATTER_AUTOTUNE", "1")
    _run_case(device, dtype, 300, 2, 8, 256, 384, "random", False, False, with_bias=True, with_gates=True)
    _run_case(device, dtype, 300, 2, 8, 256, 384, "random", True, True, with_bias=False, with_gates=False)


def test_autotune_override_wins_over_the_environment_in_its_own_thread(monkeypatch):
    import threading

    from hf_scatter.kernels.backend import autotune_enabled, autotune_override

    monkeypatch.setenv("HF_SCATTER_AUTOTUNE", "1")
    seen = []
    with autotune_override(False):
        assert not autotune_enabled()
        with autotune_override(True):
            assert autotune_enabled()
        assert not autotune_enabled()
        other = threading.Thread(target=lambda: seen.append(autotune_enabled()))
        other.start()
        other.join()
    assert seen == [True], "another thread keeps the environment's setting"
    assert autotune_enabled()
    monkeypatch.setenv("HF_SCATTER_AUTOTUNE", "0")
    assert not autotune_enabled()


def test_measured_table_config_launches_without_a_sweep_unless_autotuning_is_asked_for(monkeypatch):
    """A kernel with a table launches its table config directly (no Triton autotuner, so no seconds of
    sweeping at first use); HF_SCATTER_AUTOTUNE=1 sweeps; =0 also keeps the table."""
    from hf_scatter.kernels import backend

    calls = []

    class Config:
        kwargs, num_warps, num_stages = {"BLOCK_N": 32}, 8, 4

    class Tuned:
        best_config = None

        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append("swept")

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **meta: calls.append(("table", grid, meta["BLOCK_N"], meta["num_warps"]))

    monkeypatch.setattr(backend, "triton_interpreted", lambda: False)
    grid = lambda cfg: (128 // cfg["BLOCK_N"],)  # noqa: E731
    for setting, want in [(None, ("table", (4,), 32, 8)), ("0", ("table", (4,), 32, 8)), ("1", "swept")]:
        if setting is None:
            monkeypatch.delenv("HF_SCATTER_AUTOTUNE", raising=False)
        else:
            monkeypatch.setenv("HF_SCATTER_AUTOTUNE", setting)
        calls.clear()
        backend.launch(Kernel(), Tuned(), [], {}, grid, (), {}, {}, tune_key=("k", setting), table_config=Config())
        assert calls == [want], setting
    monkeypatch.delenv("HF_SCATTER_AUTOTUNE")
    assert backend.autotune_setting() is None and backend.autotune_enabled()  # untabled kernels still sweep


def test_table_config_that_overflows_shared_memory_drops_stages_once(monkeypatch):
    """A measured config that does not fit another GPU's or Triton release's shared memory launches with fewer
    stages instead of failing, and later launches of that key go straight to the stages that compiled; any
    other error reaches the caller."""
    from hf_scatter.kernels import backend

    class OutOfResources(Exception):  # Triton's exception, matched by name
        pass

    calls = []

    class Config:
        kwargs, num_warps, num_stages = {"BLOCK_N": 32}, 8, 5

    class Kernel:
        def __getitem__(self, grid):
            def run(*args, **meta):
                calls.append(meta["num_stages"])
                if meta["num_stages"] > 3:
                    raise OutOfResources("out of resource: shared memory")
            return run

    monkeypatch.setattr(backend, "triton_interpreted", lambda: False)
    monkeypatch.delenv("HF_SCATTER_AUTOTUNE", raising=False)
    kernel, grid = Kernel(), (lambda cfg: (1,))
    backend.launch(kernel, None, [], {}, grid, (), {}, {}, tune_key=("shape",), table_config=Config())
    assert calls == [5, 4, 3]
    calls.clear()
    backend.launch(kernel, None, [], {}, grid, (), {}, {}, tune_key=("shape",), table_config=Config())
    assert calls == [3]

    class Broken(Kernel):
        def __getitem__(self, grid):
            def run(*args, **meta):
                raise ValueError("bad argument")
            return run

    with pytest.raises(ValueError, match="bad argument"):
        backend.launch(Broken(), None, [], {}, grid, (), {}, {}, tune_key=("other",), table_config=Config())


# ------------------------------------------------------------------------ first projection + SwiGLU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize("pattern,keep", [("random", True), ("empty-expert", False), ("one-expert", True)])
def test_scatter2scatter_swiglu_equals_the_definition_and_the_unfused_kernels(device, dtype, gpt_oss, pattern, keep):
    """The gate in the first projection's epilogue: pre-activation and h against float64 per slot, and h bit for
    bit the SwiGLU kernel's over the stored pre-activation; odd I, concatenated [gate; up] and GPT-OSS's
    interleaved, biased, clamped form; outputs poisoned."""
    from hf_scatter.kernels.scatter2scatter import scatter2scatter_swiglu
    from hf_scatter.kernels.swiglu import SILU, gpt_oss_gate, swiglu_fwd_unchecked, swiglu_reference

    T, k, E, d, inter = 37, 3, 5, 48, 75
    form = gpt_oss_gate(1.702, 7.0) if gpt_oss else SILU
    idx = routing_case(T, k, E, device, pattern)
    se, ss, off = flatten_sort_count(idx, E)
    x = torch.randn(T, d, device=device, dtype=dtype) * 2
    w = (torch.randn(E, 2 * inter, d, device=device, dtype=dtype) * (3 / d ** 0.5)).transpose(1, 2)  # HF view
    bias = torch.randn(E, 2 * inter, device=device, dtype=dtype) if gpt_oss else None
    rows = x.double()[ss // k]
    pre_ref = torch.stack([rows[s] @ w.double()[e] for s, e in enumerate(se.tolist())])
    if bias is not None:
        pre_ref = pre_ref + bias.double()[se]
    h_ref = swiglu_reference(*form.halves(pre_ref), *form.numbers)
    if gpt_oss:
        assert (pre_ref[:, 0::2] > 7).any() and (pre_ref[:, 1::2].abs() > 7).any()  # both clamp branches
    with poisoned_empty():
        pre, h = scatter2scatter_swiglu(x, w, se, ss, off, k, form, bias, keep_pre_activation=keep)
    assert rel_err(h, h_ref) < TOL[dtype]
    if keep:
        assert rel_err(pre, pre_ref) < TOL[dtype]
        assert torch.equal(h, swiglu_fwd_unchecked(pre, torch.empty_like(h), form))
    else:
        assert pre is None
    with pytest.raises(ValueError, match="even d_out"):
        scatter2scatter_swiglu(x, w[:, :, :-1], se, ss, off, k)
    with pytest.raises(ValueError, match="features"):
        scatter2scatter_swiglu(x[:, :-1], w, se, ss, off, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [48, 64])  # K steps partial and whole
def test_scatter2scatter_swiglu_reads_n_contiguous_weights_alike(device, dtype, d):
    """A [gate; up] weight stored [E, d, 2I] contiguous (N contiguous: the kernels' own argument order) gives the
    pre-activation and h of the same values in transformers' [E, 2I, d] layout, with odd I and an expert without
    rows; outputs poisoned. Its gate and up halves are two products, whose sums may run in another order: fp32
    results agree to the summation's rounding, bf16 ones to their own (an H200 gave equal bits)."""
    from hf_scatter.kernels.scatter2scatter import scatter2scatter_swiglu

    T, k, E, inter = 29, 2, 4, 75
    idx = routing_case(T, k, E, device, "empty-expert")
    se, ss, off = flatten_sort_count(idx, E)
    x = torch.randn(T, d, device=device, dtype=dtype)
    w_hf = (torch.randn(E, 2 * inter, d, device=device) * d ** -0.5).to(dtype).transpose(1, 2)  # K contiguous
    w_rows = w_hf.contiguous()  # N contiguous
    assert w_rows.stride(2) == 1 and w_hf.stride(1) == 1
    with poisoned_empty():
        want = scatter2scatter_swiglu(x, w_hf, se, ss, off, k)
        got = scatter2scatter_swiglu(x, w_rows, se, ss, off, k)
    close = 1e-5 if dtype == torch.float32 else 2.0 ** -8
    assert rel_err(got[0], want[0].double()) < close and rel_err(got[1], want[1].double()) < close
    rows = x.double()[ss // k]
    pre_ref = torch.stack([rows[s] @ w_hf.double()[e] for s, e in enumerate(se.tolist())])
    assert rel_err(got[0], pre_ref) < TOL[dtype]


@pytest.mark.parametrize("layout", ["k_contiguous", "n_contiguous"])
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_through_tma_descriptors_in_persistent_programs(device, layout, glu, dtype):
    """A 16-bit weight whose experts' rows one 2-D descriptor spans takes the TMA path (checked: transformers'
    K-contiguous layout and the N-contiguous one), and the products equal float64 per slot with a last column tile
    past the experts' columns (its extra columns read the next expert's rows and are never stored), an expert
    without rows, and more tiles than programs (the interpreter runs 3: each program loops over row and column
    tiles); outputs poisoned."""
    from hf_scatter.kernels.scatter2scatter import (TensorDescriptor, _has_tma, _weight_descriptor,
                                                    scatter2scatter_swiglu, tile_rows)
    from hf_scatter.kernels.swiglu import SILU, swiglu_reference

    T, k, E, d, N = 300, 2, 4, 64, 208  # 128-column tiles (64 for a [gate; up] half) over 208 (104) columns
    idx = routing_case(T, k, E, device, "empty-expert")
    se, ss, off = flatten_sort_count(idx, E)
    assert tile_rows(T * k, E) == 128  # training-sized tiles: the ones that take TMA
    x = torch.randn(T, d, device=device, dtype=dtype)
    if layout == "k_contiguous":
        w = (torch.randn(E, N, d, device=device) * d ** -0.5).to(dtype).transpose(1, 2)
    else:
        w = (torch.randn(E, d, N, device=device) * d ** -0.5).to(dtype)
    tma = _has_tma(device) and TensorDescriptor is not None  # a Hopper GPU or the interpreter, Triton 3.3 on
    want_mode = {"k_contiguous": 1, "n_contiguous": 2}[layout] if tma else 0
    assert _weight_descriptor(w, {"BLOCK_N": 128, "BLOCK_K": 64}, glu)[1] == want_mode
    if layout == "n_contiguous" and glu:  # an up half starting off a 16-byte boundary keeps the plain loads
        assert _weight_descriptor(w[:, :, :200].contiguous(), {"BLOCK_N": 128, "BLOCK_K": 64}, glu)[1] == 0
    rows = x.double()[ss // k]
    pre_ref = torch.stack([rows[s] @ w.double()[e] for s, e in enumerate(se.tolist())])  # expert order
    with poisoned_empty():
        if glu:
            pre, h = scatter2scatter_swiglu(x, w, se, ss, off, k)
            assert rel_err(pre, pre_ref) < TOL[dtype]
            assert rel_err(h, swiglu_reference(*SILU.halves(pre_ref), *SILU.numbers)) < TOL[dtype]
        else:
            y = scatter2scatter(x, w, se, ss, off, fan_out=k)  # scattered out: row ss[i] of slot i
            assert rel_err(y, torch.empty_like(pre_ref).index_copy_(0, ss, pre_ref)) < TOL[dtype]


def test_hf_scatter_tma_off_keeps_the_plain_loads(device, monkeypatch):
    """``HF_SCATTER_TMA=0`` (an A/B in one process, or a way around a driver's TMA trouble) launches the product
    without descriptors, with the same values; unset, the same call makes one."""
    from hf_scatter.kernels import scatter2scatter as module

    if module.TensorDescriptor is None:
        pytest.skip("this Triton (before 3.3) has no tensor descriptors: the plain loads are the only path")
    made = []

    def counting(*args):
        made.append(args[1])
        return real(*args)

    real = module.TensorDescriptor
    monkeypatch.setattr(module, "TensorDescriptor", counting)
    T, k, E, d, N = 300, 2, 4, 64, 64
    se, ss, off = flatten_sort_count(routing_case(T, k, E, device), E)
    x = torch.randn(T, d, device=device, dtype=torch.bfloat16)
    w = torch.randn(E, N, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
    with_tma = scatter2scatter(x, w, se, ss, off, fan_out=k)
    assert len(made) == (1 if module._has_tma(device) else 0)
    monkeypatch.setenv("HF_SCATTER_TMA", "0")
    made.clear()
    plain = scatter2scatter(x, w, se, ss, off, fan_out=k)
    assert made == [] and torch.equal(plain, with_tma)
