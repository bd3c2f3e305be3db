"""Offloaded generation over several GPUs (tensor parallelism): two processes, each holding and streaming half of
every layer, give vanilla ``generate``'s tokens. On the CPU two gloo processes play the two GPUs (the same
pipeline, the same all-reduces); on a host of two GPUs, NCCL."""

import dataclasses
import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from offload_cases import BUILDERS, padded, requests
from spawned_ranks import leave_rank

WORLD = 2
# every family that offloads splits over GPUs (OLMoE's q/k norms span every head: summed over the ranks; DeepSeek's
# latent attention: every rank caches the whole latent)
SPLIT = ["mixtral", "dbrx", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "deepseek_v2", "qwen2_moe", "granitemoe"]
NEW_TOKENS = 8


def _loaded_in_turns(rank: int, device: str, root: str, group) -> dict:
    """A checkpoint path and a loader: the ranks load one after the other (their loads never overlap), and the
    tokens are vanilla generate's."""
    import hf_scatter
    from hf_scatter.offload import Policy
    from transformers import AutoModelForCausalLM

    checkpoint = os.path.join(root, "mixtral")  # saved by the test from BUILDERS["mixtral"]
    reqs = requests()
    ids, mask = padded(reqs)
    vanilla = BUILDERS["mixtral"]().generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                             pad_token_id=0)
    spans = []

    def loader():
        start = time.monotonic()  # one clock for every process of the host
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        time.sleep(0.5)  # a load long enough that two at once would overlap
        spans.append((start, time.monotonic()))
        return model

    out = {}
    for name, model in (("loader", loader), ("path", checkpoint)):
        off = hf_scatter.offload_model(model, gpu_memory="1GiB", device=device, group=group, progress=False,
                                       policy=Policy(3, 2, weights_gpu_fraction=0.5, gpus=WORLD))
        out[name] = torch.equal(off.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                                             progress=False).cpu(), vanilla)
        off.close()
    out["span"] = spans[0]
    return out


def _rank_results(rank: int, device: str) -> dict:
    """What this rank saw for every family: its tokens against vanilla generate, its logits against the model's,
    the share of the weights it stores, and each refusal's message."""
    import hf_scatter
    import hf_scatter.offload.runtime.offloaded as runtime
    from hf_scatter.offload import PlanError, Policy
    from hf_scatter.offload.families.registry import adapter_for
    from hf_scatter.offload.runtime.paging import Layout

    group = dist.group.WORLD
    out = {}
    for family in SPLIT:
        model = BUILDERS[family]()
        reqs = requests()
        ids, mask = padded(reqs)
        vanilla = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        eos = vanilla[1, ids.shape[1] + 3].item()  # a request that ends mid-way, on both ranks at the same step
        held = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                              eos_token_id=eos)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits.float()
        whole = Layout(adapter_for(model), 0.5)
        off = hf_scatter.offload_model(model, gpu_memory="1GiB", device=device, group=group, progress=False,
                                       policy=Policy(3, 2, weights_gpu_fraction=0.5, gpus=WORLD))
        got = off.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, progress=False)
        result = off.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, progress=False,
                              return_dict=True)
        got_eos = result.sequences
        sampled = off.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, seed=3, progress=False)
        # without a seed too: rank 0 draws it for every rank
        unseeded = off.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=True, progress=False)
        mine = off.logits(ids, attention_mask=mask).float()
        try:  # requests that differ between ranks are stopped before the first all-reduce
            off.generate(ids[:, 1:] if rank else ids, max_new_tokens=2, progress=False)
            refused = "not refused"
        except RuntimeError as e:
            refused = str(e)
        try:  # a call only one rank refuses raises on every rank, the others naming it
            off.generate(ids, attention_mask=mask, max_new_tokens=0 if rank else 2, progress=False)
            alone = "not refused"
        except (ValueError, RuntimeError) as e:
            alone = f"{type(e).__name__}: {e}"
        keep = mask.bool()
        out[family] = {
            "tokens_equal": torch.equal(got.cpu(), vanilla), "eos_equal": torch.equal(got_eos.cpu(), held),
            "graph_replays": result.stats["graph_replays"],
            "sampled": sampled.tolist(), "unseeded": unseeded.tolist(), "alone": alone,
            "logits_error": (mine[keep] - logits[keep]).abs().max().item(),
            "logits_scale": logits[keep].abs().max().item(),
            "stored": off.store.layout.device_bytes + off.store.layout.host_bytes,
            "whole": whole.device_bytes + whole.host_bytes,
            "heads": off.dims.heads, "full_heads": off.adapter.full_dims.heads, "repr": repr(off),
            "different_requests": refused}
        off.close()
    try:  # ranks given different arguments are stopped at the first collective, before any work
        hf_scatter.offload_model(BUILDERS["mixtral"](), gpu_memory="1GiB" if rank == 0 else "2GiB", device=device,
                                 group=group, progress=False, policy=Policy(3, 2, weights_gpu_fraction=0.5, gpus=WORLD))
        out["different_arguments"] = "not refused"
    except ValueError as e:
        out["different_arguments"] = str(e)
    # ranks whose plans differ all the same (the H100 bug: rank 0 alone held the output biases, so its prefill
    # group was a token longer) are stopped before any weight moves, instead of hanging in an all-reduce
    real = runtime.plan_device
    runtime.plan_device = lambda *a, **k: dataclasses.replace(real(*a, **k), group_tokens=real(*a, **k).group_tokens
                                                              - rank)
    try:
        hf_scatter.offload_model(BUILDERS["mixtral"](), gpu_memory="1GiB", device=device, group=group, progress=False,
                                 policy=Policy(3, 2, weights_gpu_fraction=0.5, gpus=WORLD))
        out["different_plans"] = "not refused"
    except RuntimeError as e:
        out["different_plans"] = str(e)
    finally:
        runtime.plan_device = real
    odd = BUILDERS["mixtral"](kv_heads=1, intermediate=95)
    for name, call in (("odd", lambda: hf_scatter.offload_model(odd, device=device, group=group, progress=False,
                                                                  policy=Policy(2, 1, gpus=WORLD))),
                       ("one_gpu_policy", lambda: hf_scatter.offload_model(BUILDERS["mixtral"](), device=device,
                                                                            group=group, progress=False,
                                                                            policy=Policy(2, 1)))):
        try:
            call()
            out[name] = "not refused"
        except (ValueError, PlanError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _worker(rank: int, init_file: str, out: str, backend: str, device: str, root: str) -> None:
    os.environ["HF_SCATTER_KERNELS"] = "torch" if device == "cpu" else os.environ.get("HF_SCATTER_KERNELS", "auto")
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    # a collective that waits longer than this is a deadlock: fail the test instead of stalling the suite
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    try:
        results = _rank_results(rank, device)
        results["turns"] = _loaded_in_turns(rank, device, root, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    leave_rank()


def _run(tmp_path, backend: str, device: str) -> list[dict]:
    out = str(tmp_path / "out")
    BUILDERS["mixtral"]().save_pretrained(tmp_path / "mixtral")
    mp.start_processes(_worker, args=(str(tmp_path / "init"), out, backend, device, str(tmp_path)), nprocs=WORLD,
                       start_method="spawn", join=True)
    return [json.load(open(f"{out}.{r}")) for r in range(WORLD)]


def _check(ranks: list[dict], graphed: bool) -> None:
    """``graphed``: decode stages, their all-reduces included, ran as CUDA graphs (NCCL on GPUs) wherever decode
    streams whole stages (routed streaming stays eager), every rank alike."""
    replays = [[r[family]["graph_replays"] for family in SPLIT] for r in ranks]
    assert replays[0] == replays[1] and (sum(replays[0]) > 0) == graphed, replays
    for family in SPLIT:
        seen = [r[family] for r in ranks]
        for rank, got in enumerate(seen):
            assert got["tokens_equal"], (family, rank)
            assert got["eos_equal"], (family, rank)
            # fp32 sums in another order: a few ulps of the largest logit, over the model's few layers
            assert got["logits_error"] <= 1e-5 * max(1.0, got["logits_scale"]), (family, rank, got["logits_error"])
            # each rank holds half of every layer (its heads and expert columns; norms and routers whole)
            assert 0.45 * got["whole"] <= got["stored"] <= 0.55 * got["whole"], (family, got)
            assert got["heads"] * WORLD == got["full_heads"]
            assert f"(rank {rank} of {WORLD})" in got["repr"]
            assert "were given different generate() calls ({'tokens': [" in got["different_requests"], got
        assert seen[0]["sampled"] == seen[1]["sampled"], family  # sampling draws the same tokens on every rank
        assert seen[0]["unseeded"] == seen[1]["unseeded"], family
        assert seen[1]["alone"].startswith("ValueError: max_new_tokens must be a positive integer"), seen[1]["alone"]
        assert seen[0]["alone"].startswith("RuntimeError: rank 1 of the tensor-parallel group failed, so this rank "
                                           "stops too: ValueError: max_new_tokens"), seen[0]["alone"]
    turns = [r["turns"] for r in ranks]
    assert all(t["loader"] and t["path"] for t in turns), turns
    (a0, b0), (a1, b1) = turns[0]["span"], turns[1]["span"]
    assert b0 <= a1, turns  # rank 1 loaded after rank 0 had finished (one whole model in host memory at a time)
    for r in ranks:
        assert "1 KV heads, 95 expert columns" in r["odd"] and "a GPU count that divides them" in r["odd"], r["odd"]
        assert r["one_gpu_policy"].startswith("PlanError") and "gpus=2" in r["one_gpu_policy"]
        assert "planned differently ({'group_tokens': [" in r["different_plans"], r["different_plans"]
        assert "were given different arguments" in r["different_arguments"], r["different_arguments"]


def test_two_gloo_ranks_split_every_layer_and_give_vanilla_tokens(tmp_path):
    _check(_run(tmp_path, "gloo", "cpu"), graphed=False)


@pytest.mark.gpu
def test_two_gpus_split_every_layer_and_give_vanilla_tokens(tmp_path):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs (a multi-GPU host: docs/development.md)")
    _check(_run(tmp_path, "nccl", "cuda"), graphed=True)


@pytest.mark.gpu
def test_bench_offload_over_gpu_counts_small(tmp_path):
    """``hf-scatter bench offload --gpus 1,2``: one torchrun per count, the same tokens on every rank, each GPU
    within its budget and holding half the weights at two GPUs, and the HRM's prediction for each count."""
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs (a multi-GPU host: docs/development.md)")
    from hf_scatter.cli import main

    out, png = tmp_path / "gpus.json", tmp_path / "gpus.png"
    assert main(["bench", "offload", "--gpus", "1,2", "--model", "mixtral-8x7b", "--layers", "2", "--requests", "64",
                 "--new-tokens", "4", "--gpu-memory", "8GiB", "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    one, two = report["by_gpus"]
    assert (one["gpus"], two["gpus"]) == (1, 2) and len(two["ranks"]) == 2
    for row in (one, two):
        assert row["same_tokens_on_every_rank"] and row["within_budget"], row
        assert row["tokens_per_s"] > 0 and row["predicted"]["tokens_per_s"] > 0
    whole = one["ranks"][0]["host_weight_bytes"] + one["ranks"][0]["device_weight_bytes"]
    for r in two["ranks"]:
        assert 0.45 * whole <= r["host_weight_bytes"] + r["device_weight_bytes"] <= 0.55 * whole
    assert png.stat().st_size > 0
