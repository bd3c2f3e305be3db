"""Device and host memory of a run (runtime/memory.py): budgets checked before any work, refusals naming the
request, prefill chunks, cuBLAS's workspace, decode's CUDA graphs; on the GPU, the budget held."""

import dataclasses

import pytest
import torch

import hf_scatter
from hf_scatter.offload import PlanError, Policy
from hf_scatter.offload.families.registry import adapter_for
from hf_scatter.offload.runtime.paging import Layout
from hf_scatter.tiny import tiny_mixtral

from offload_cases import padded, requests, torch_kernels_on_cpu, vanilla_new_tokens  # noqa: F401 - the autouse fixture


def test_requests_that_cannot_fit_are_refused_with_their_index():
    model = tiny_mixtral()
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", cpu_memory="4MiB", device="cpu", policy=Policy(4, 2),
                                   release_weights=False, progress=False)
    # per token the KV cache takes 2 layers x 2 (K, V) x 32 x 4 bytes = 512 B; ~3.5 MiB are left after the weights
    reqs = [torch.randint(3, 384, (n,)) for n in (10, 20_000, 15)]
    with pytest.raises(PlanError, match=r"request 1 \(20000 prompt tokens"):
        off.generate(prompts=None, input_ids=padded(reqs)[0], attention_mask=padded(reqs)[1], max_new_tokens=4,
                     progress=False)
    with pytest.raises(PlanError, match="gpu_memory|GPU budget"):
        hf_scatter.offload_model(tiny_mixtral(), gpu_memory="64KiB", device="cpu", policy=Policy(4, 2), progress=False)
    with pytest.raises(ValueError, match="attention on the CPU"):
        hf_scatter.offload_model(tiny_mixtral(), device="cpu", policy=Policy(4, 2, attention_on_gpu=True),
                                 progress=False)
    with pytest.raises(ValueError, match="supports dbrx, deepseek_v2, deepseek_v3, gpt_oss, granitemoe, mixtral"):
        hf_scatter.offload_model(torch.nn.Linear(2, 2), device="cpu")


def test_batch_shrinks_to_what_host_memory_holds():
    model = tiny_mixtral()
    reqs = requests((40,) * 8)
    ids, mask = padded(reqs)
    alone = vanilla_new_tokens(model, reqs, 4)
    # KV of one request: (40 + 3) tokens x 512 B = 21.5 KiB; ~60 KiB of host memory left fits two at a time
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(8, 4), progress=False,
                                   cpu_memory=Layout(adapter_for(model), 0.0).host_bytes + 60 * 1024)
    result = off.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[], return_dict=True,
                          progress=False)
    assert result.stats["batch_size"] < 8 and result.stats["batches"] > 1
    assert result.tokens == alone


def test_cublas_workspace_is_reserved_as_pytorch_sizes_it():
    from hf_scatter.offload.runtime.memory import cublas_workspace_bytes, cublas_workspace_size

    assert cublas_workspace_size("", 9) == 32 * 2**20  # Hopper's default
    assert cublas_workspace_size("", 8) == (4096 * 2 + 16 * 8) * 1024
    assert cublas_workspace_size(":4096:8", 8) == 32 * 2**20 and cublas_workspace_size(":16:8:4096:1", 9) == 4224 * 1024
    assert cublas_workspace_bytes("cpu") == 0


def test_decode_graphs_are_planned_where_they_run(monkeypatch):
    """Decode's CUDA graphs hold a stage's temporaries and each row's QKV for the whole run: the device plan
    reserves them, and only where the stages are graphed (a CUDA device, tensor-parallel ranks too, not turned
    off)."""
    from hf_scatter.offload.plan.activations import graph_bytes, stage_bytes
    from hf_scatter.offload.runtime.memory import plan_device
    from hf_scatter.offload.runtime.stage_graphs import graphs_wanted

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_wanted(cuda) and not graphs_wanted(cpu)
    monkeypatch.setenv("HF_SCATTER_OFFLOAD_GRAPHS", "0")
    assert not graphs_wanted(cuda)
    adapter = adapter_for(tiny_mixtral())
    d = adapter.dims
    plain = plan_device(adapter, 0.0, 2**30, 8, 4, 4)
    graphed = plan_device(adapter, 0.0, 2**30, 8, 4, 4, graphs=True)
    assert graph_bytes(d, 8, 4, 4) == stage_bytes(d, 4, 4) + 8 * d.qkv_dim * 4
    assert graphed.breakdown()["decode CUDA graphs"] == graph_bytes(d, 8, 4, 4)
    assert plain.available - graphed.available == graph_bytes(d, 8, 4, 4)
    assert "decode CUDA graphs" not in plain.breakdown()
    off = hf_scatter.offload_model(tiny_mixtral(), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    assert off.memory()["device"]["cuBLAS workspace"] == 0


@pytest.mark.gpu
def test_gpu_memory_stays_within_the_budget_and_transfers_overlap(tmp_path):
    """A bf16 model of ~0.4 GB in a 192 MiB budget (32 of them cuBLAS's workspace on Hopper): most of every
    layer streams through the double buffer."""
    model = tiny_mixtral(hidden=512, intermediate=2048, experts=8, top_k=2, heads=8, kv_heads=2, layers=8,
                         vocab=2048, dtype=torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = 192 * 2**20
    assert weights > 2 * budget
    reqs = [torch.randint(3, 2048, (n,)) for n in torch.randint(20, 120, (48,)).tolist()]
    ids, mask = padded(reqs)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    off = hf_scatter.offload_model(model, gpu_memory=budget, device="cuda",
                                   policy=Policy(32, 8, weights_gpu_fraction=0.1), progress=False)
    assert 0 < off.store.layout.fraction <= 0.1
    result = off.generate(ids, attention_mask=mask, max_new_tokens=16, return_dict=True, progress=False,
                          trace=str(tmp_path / "trace.json"))
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget, f"peak {peak / 2**20:.1f} MiB > budget {budget / 2**20:.0f} MiB"
    assert result.stats["batches"] == 2 and len(result.tokens) == 48
    assert result.stats["graph_replays"] > 0  # decode stages ran as CUDA graphs, within the budget
    trace = result.stats["trace"]
    assert trace["weight_transfer_overlap"] > 0.3, trace  # copies run while the GPU or the CPU computes
    off.close()


def test_prefill_chunks_are_not_shrunk_by_a_large_vocabulary():
    """The LM head's slice is the same for every chunk: with Qwen3's 152k vocabulary it took a quarter of 1.4 GiB
    of activations by itself and left 256-token chunks (measured: prefill 47 s against 0.5 s planned)."""
    from hf_scatter.common.shapes import builtin_config
    from hf_scatter.offload.families.adapter import Dims
    from hf_scatter.offload.plan.activations import (chunk_tokens, head_bytes, prefill_bytes, stage_bytes,
                                                     workspace_bytes)

    d = Dims.of(builtin_config("qwen3-30b-a3b", num_hidden_layers=24), None)
    available = int(1.39 * 2**30)
    chunk = chunk_tokens(d, 1024, available, 2)
    assert chunk == 2048 and workspace_bytes(d, 512, 2) > available // 4  # head included, 512 was too many
    assert stage_bytes(d, chunk, 2) <= (available - head_bytes(d, chunk, 2)) // 4
    assert prefill_bytes(d, 1024, chunk, chunk, 2) <= available


def test_a_plan_leaves_the_runtime_the_prefill_chunks_it_prices():
    """The planner reserves activations by the runtime's own model: the runtime, given the planned resident
    fraction, keeps it and picks prefill chunks at least as large as the planner priced. With a coarser model
    of its own (470 MiB of activations), the planner left this GPT-OSS-120B plan room for 64-token chunks where
    it had priced 4096."""
    from hf_scatter.offload import ModelSpec, Workload, load_profile, search_policy
    from hf_scatter.offload.plan.activations import PREFILL_CHUNK_TOKENS, chunk_tokens, decode_bytes
    from hf_scatter.offload.runtime.memory import plan_device

    profile = load_profile("h100-host-anchors")
    gpt_oss = dataclasses.replace(ModelSpec.from_config("gpt-oss-120b"), layers=10)  # MXFP4 experts
    workload = Workload(76, 32, num_requests=1024, prompt_len_max=114)
    policy = search_policy(gpt_oss, profile, workload, "16GiB", "80GiB", placements=[(False, True)])
    reserved = policy.prediction.gpu_memory["activations"]
    priced = policy.prediction.prefill_chunk_tokens
    assert policy.batch_size * workload.prompt_len > PREFILL_CHUNK_TOKENS >= priced >= 1024, policy
    assert chunk_tokens(gpt_oss, policy.batch_size, reserved, 2) >= priced
    assert decode_bytes(gpt_oss, policy.batch_size, policy.micro_batch_size, 2) <= reserved
    # a batch whose prompts (12 x 76 tokens) the plan prefills in one call: the runtime's power-of-two chunk holds it
    qwen3 = dataclasses.replace(ModelSpec.from_config("qwen3-30b-a3b", weights="bf16"), layers=6)
    small = Workload(76, 32, num_requests=12, prompt_len_max=114)
    policy = search_policy(qwen3, profile, small, "16GiB", "80GiB", placements=[(False, True)])
    priced = policy.prediction.prefill_chunk_tokens
    assert priced == policy.batch_size * small.prompt_len == 912, policy
    assert chunk_tokens(qwen3, policy.batch_size, policy.prediction.gpu_memory["activations"], 2) >= priced

    model = tiny_mixtral(hidden=256, intermediate=512, layers=4, vocab=2048, dtype=torch.bfloat16)
    adapter, spec = adapter_for(model), ModelSpec.from_config(model.config)
    workload = Workload(64, 8, num_requests=256)
    fractions = []
    for mib in (18, 24, 28):  # the weights are 15.5 MiB: partly resident
        budget = mib * 2**20
        policy = search_policy(spec, profile, workload, budget, placements=[(False, True)])
        plan = plan_device(adapter, policy.weights_gpu_fraction, budget, policy.batch_size, policy.micro_batch_size, 2)
        assert plan.layout.requested_fraction == policy.weights_gpu_fraction  # not shrunk to make room
        assert plan.chunk_tokens >= policy.prediction.prefill_chunk_tokens
        fractions.append(policy.weights_gpu_fraction)
    assert 0 < min(fractions) and max(fractions) < 1

