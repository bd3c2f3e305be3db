"""`hf-scatter demo`: run every kernel and patch that exists against its reference, offline, and print a table.

Each check returns a :class:`CheckResult`; a failed tolerance makes the command exit non-zero, so the
demo doubles as an end-to-end smoke test on any machine.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import Callable

import torch


@dataclasses.dataclass
class CheckResult:
    subject: str
    implementation: str
    max_abs_diff: float
    tolerance: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def _timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = fn()
    if out.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_group_kernel(quick: bool) -> CheckResult:
    from .kernels.backend import kernel_path
    from .kernels.group import group, group_reference

    device = _device()
    tokens, dim, fan_out = (37, 100, 2) if quick else (301, 600, 4)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, dim, generator=gen).to(device)
    idx = torch.randperm(tokens * fan_out, generator=gen).to(device)
    coeff = torch.rand(tokens * fan_out, generator=gen).to(device)
    out, seconds = _timed(lambda: group(x, idx, fan_out, coeff))
    ref = group_reference(x.double(), idx, fan_out, coeff.double())
    diff = (out.double() - ref).abs().max().item()
    return CheckResult(f"kernel group [{tokens}x{dim}, k={fan_out}]", kernel_path(device), diff, 1e-5, seconds)


def check_smoe_mlp(quick: bool) -> CheckResult:
    """ScatterMoE SwiGLU experts against transformers' own Mixtral experts (eager loop), forward + backward."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from .kernels.backend import kernel_path
    from .moe import glu_experts
    from .tiny import tiny_mixtral_config

    device = _device()
    tokens, hidden, experts, top_k, inter = (24, 64, 4, 2, 96) if quick else (200, 72, 6, 3, 100)
    torch.manual_seed(0)
    config = tiny_mixtral_config(hidden=hidden, experts=experts, top_k=top_k, intermediate=inter)
    config._experts_implementation = "eager"  # a standalone experts module: its reference loop
    hf = MixtralExperts(config)
    torch.nn.init.normal_(hf.gate_up_proj, std=0.1)
    torch.nn.init.normal_(hf.down_proj, std=0.1)
    hf = hf.to(device)
    x = torch.randn(tokens, hidden, device=device)
    gates, idx = torch.softmax(torch.randn(tokens, experts, device=device), -1).topk(top_k, -1)
    want = hf(x, idx, gates)
    out, seconds = _timed(lambda: glu_experts(x, hf.gate_up_proj, hf.down_proj, idx, gates))
    diff = (out - want).abs().max().item()
    return CheckResult(f"SMoE SwiGLU vs HF MixtralExperts [T={tokens}, E={experts}, k={top_k}]",
                       f"scattermoe ({kernel_path(device)})", diff, 1e-4, seconds)


def _check_patched_model(family: str, quick: bool) -> CheckResult:
    """A tiny model after ``patch_model`` against a vanilla copy: logits, then greedy tokens (a token
    mismatch counts as an infinite difference)."""
    import copy

    from . import patch_model
    from .kernels.backend import kernel_path
    from .tiny import TINY_BUILDERS

    device = _device()
    size = {} if quick else {"hidden": 72, "experts": 6, "top_k": 3, "intermediate": 40}
    vanilla = TINY_BUILDERS[family](**size).to(device)
    patched = patch_model(copy.deepcopy(vanilla))
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        logits, seconds = _timed(lambda: patched(ids).logits)
        diff = (logits - vanilla(ids).logits).abs().max().item()
    generate = dict(max_new_tokens=4 if quick else 12, do_sample=False, pad_token_id=0)
    if not torch.equal(patched.generate(ids, **generate), vanilla.generate(ids, **generate)):
        diff = float("inf")
    return CheckResult(f"tiny {family}: patch_model logits + greedy generate ({_patched_summary(patched)})",
                       f"hf-scatter ({kernel_path(device)})", diff, 1e-4, seconds)


def _patched_summary(model) -> str:
    from collections import Counter

    from . import patch_report

    counts = Counter(impl.split(" ")[0] for impl in patch_report(model).values())
    return ", ".join(f"{n} {impl}" for impl, n in sorted(counts.items()))


def check_bert(quick: bool) -> CheckResult:
    """A tiny BERT encoder after ``patch_model`` (fused residual add + LayerNorm) against a vanilla copy."""
    import copy

    from . import patch_model
    from .kernels.backend import kernel_path
    from .tiny import tiny_bert

    device = _device()
    vanilla = tiny_bert(**({} if quick else {"hidden": 72, "intermediate": 100})).to(device)
    patched = patch_model(copy.deepcopy(vanilla))
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        out, seconds = _timed(lambda: patched(ids).last_hidden_state)
        diff = (out - vanilla(ids).last_hidden_state).abs().max().item()
    return CheckResult(f"tiny bert: patch_model hidden states ({_patched_summary(patched)})",
                       f"hf-scatter ({kernel_path(device)})", diff, 1e-4, seconds)


def check_mixtral(quick: bool) -> CheckResult:
    return _check_patched_model("mixtral", quick)


def check_dbrx(quick: bool) -> CheckResult:
    return _check_patched_model("dbrx", quick)


CHECKS: list[Callable[[bool], CheckResult]] = [check_group_kernel, check_smoe_mlp, check_mixtral, check_dbrx,
                                               check_bert]


def format_table(results: list[CheckResult]) -> str:
    header = ("check", "implementation", "max abs diff", "tolerance", "time", "status")
    rows = [(r.subject, r.implementation, f"{r.max_abs_diff:.2e}", f"{r.tolerance:.0e}",
             f"{r.seconds * 1e3:.1f} ms", "ok" if r.ok else "FAIL") for r in results]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def run_demo(quick: bool = False) -> int:
    """The header (this machine's kernel path, as ``hf-scatter env`` says it), then every check: here, or on a
    machine without a GPU in a fresh process with the Triton interpreter on (Triton fixes interpreted or
    compiled at its first import, which this process is past, and importing hf_scatter does not switch it on)."""
    from .env import environment_report, needs_fresh_interpreter

    report = environment_report()
    print(f"hf-scatter {report['hf-scatter']} on {report['device']}; kernel path: {report['kernel path']}",
          flush=True)
    if needs_fresh_interpreter(_device()):
        env = {**os.environ, "TRITON_INTERPRET": "1", "HF_SCATTER_KERNELS": "triton"}
        return subprocess.call([sys.executable, "-m", __name__, *(["--quick"] if quick else [])], env=env)
    return run_checks(quick)


def run_checks(quick: bool = False) -> int:
    """Every check under the demo's kernels, the table, and 0 if all passed."""
    from .env import demo_kernels

    with demo_kernels():
        results = [check(quick) for check in CHECKS]
    print(format_table(results))
    failed = [r.subject for r in results if not r.ok]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        return 1
    print(f"all {len(results)} checks passed")
    return 0


if __name__ == "__main__":  # run_demo's fresh process
    sys.exit(run_checks(quick="--quick" in sys.argv[1:]))
