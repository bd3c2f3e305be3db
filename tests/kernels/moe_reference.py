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
