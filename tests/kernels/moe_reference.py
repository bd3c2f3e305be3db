"""Float64 per-slot reference for ParallelLinear, written from the API's definition (no kernels involved)."""

import torch


def reference_parallel_linear(x, weight, k, expert_idxs, bias=None, gates=None, grouped_in=False, grouped_out=False):
    """Same contract as ``hf_scatter.moe.parallel_linear``; loops over slots, so keep sizes small. ``gates``
    [S, j] with S*j = T*k: output row s = sum_i gates[s, i] * y[s*j + i] (j need not be k)."""
    flat = expert_idxs.reshape(-1)
    M = flat.numel()
    order = torch.sort(flat, stable=True).indices  # slot of each sorted position
    if grouped_in:
        slot_x = torch.empty((M, x.shape[1]), dtype=x.dtype, device=x.device)
        slot_x = slot_x.index_put((order,), x)  # x[i] is the input of slot order[i]
    else:
        slot_x = x[torch.arange(M, device=x.device) // k]
    rows = []
    for s in range(M):
        e = int(flat[s])
        y = slot_x[s] @ weight[e]
        rows.append(y + bias[e] if bias is not None else y)
    y_slot = torch.stack(rows) if rows else x.new_zeros((0, weight.shape[2]))
    if gates is not None:
        return (gates.unsqueeze(-1) * y_slot.view(*gates.shape, y_slot.shape[1])).sum(1)
    return y_slot[order] if grouped_out else y_slot


def routing_case(T, k, E, device, empty_expert: bool):
    """Random top-k ids [T, k] (expert 0 never chosen with ``empty_expert``) and their sort."""
    from hf_scatter.moe import flatten_sort_count

    g = torch.Generator().manual_seed(T * k + E)
    first = 1 if empty_expert else 0
    idx = torch.stack([first + torch.randperm(E - first, generator=g)[:k] for _ in range(T)]).to(device)
    return idx, flatten_sort_count(idx, E)


def relative_error(out, ref):
    """||out - ref|| / ||ref|| in float64, after checking that every value was written (outputs start poisoned)."""
    assert out.shape == ref.shape and out.isfinite().all(), "unwritten (poisoned) rows"
    return ((out.double() - ref).norm() / ref.norm()).item()


def scatter2scatter_error(weight, values, device, dtype, x_grouped, y_grouped, with_bias, empty_expert):
    """:func:`scatter2scatter` of a quantized ``weight`` ([E, K, N] in kernel layout, 29 tokens routed to 3 of
    E experts) into a poisoned output, against the float64 product with ``values`` (its values, [E, K, N]
    float64): the relative error."""
    from hf_scatter.kernels.scatter2scatter import scatter2scatter

    (E, K, N), T, k = weight.shape, 29, 3
    _, (se, ss, off) = routing_case(T, k, E, device, empty_expert)
    bias = torch.randn(E, N, device=device, dtype=dtype) if with_bias else None
    x_tok = torch.randn(T, K, device=device, dtype=dtype)
    x = x_tok[ss // k] if x_grouped else x_tok
    out = torch.full((T * k, N), float("nan"), device=device, dtype=dtype)
    scatter2scatter(x, weight, se, ss, off, fan_out=1 if x_grouped else k, x_grouped=x_grouped, y_grouped=y_grouped,
                    bias=bias, out=out)
    rows = x_tok.double().cpu()[ss.cpu() // k]  # slot order of the sort
    want = torch.einsum("sk,skn->sn", rows, values[se.cpu()])
    if bias is not None:
        want += bias.double().cpu()[se.cpu()]
    if not y_grouped:
        want = torch.empty_like(want).index_copy_(0, ss.cpu(), want)
    return relative_error(out.cpu(), want)
