"""Benchmarks behind ``hf-scatter bench SUITE``: every peer measured in the same process, JSON + Markdown out.

A suite is one module here, listed in :data:`SUITES`, exposing ``NEEDS_GPU``, ``add_arguments(parser)`` (its
own flags, named after ``run``'s keyword arguments), ``run(**flags) -> report`` (None on the ranks other than 0
of a distributed run, which leave writing and printing to rank 0), ``to_markdown(report)`` and
``plot(report, path)``, and optionally ``check_flags(**flags)`` (raises ValueError on flags that do not fit
together, before the GPU check). The CLI builds one sub-command per suite from these; a new suite is a new module and
a line here.
"""

SUITES = {
    "moe": "one SMoE SwiGLU layer (Mixtral to Qwen3 / GPT-OSS / DeepSeek shapes) vs HF eager / grouped_mm / batched_mm, Liger and a dense MLP of equal FLOPs",
    "train": "training steps of ~1-2B Mixtral, DBRX, Qwen3-MoE, GPT-OSS and DeepSeek-V3, or published shapes' "
             "layers (--shape), vanilla vs Liger vs patched, unwrapped or under FSDP2 / expert parallelism / ZeRO-3 "
             "at any world size (torchrun)",
    "loss": "LM head + cross-entropy: transformers' unfused loss vs Liger's and cut-cross-entropy's fused ones",
    "norms": "fused LayerNorm / RMSNorm / softmax / router vs torch, GB/s against the copy roof, BERT-base forward",
    "convert": "conversion GB/s and CPU load time, HF vs hf-scatter layout (no GPU needed)",
    "bert": "packed BERT-base inference vs padded SDPA (latency, throughput, memory)",
    "serve": "Poisson-arrival BERT serving: no batching / naive / DP batching, vanilla vs packed",
    "offload": "offloaded generation of a published shape (--model): CGOPipe vs HF accelerate offload vs the HRM",
}


def suite(name: str):
    """The module of suite ``name`` (imported on first use: suites import torch and the models)."""
    import importlib

    return importlib.import_module(f".{name}", __name__)
