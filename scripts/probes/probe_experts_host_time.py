"""Host time per call of a patched Mixtral MoE layer, no profiler active: for before/after comparisons of
host-side changes (run the same script against two source trees).

Measured: the experts layer alone (``MixtralExperts`` on the ``scattermoe`` backend) and the whole sparse MoE
block (fused router + experts), each forward under ``no_grad`` and forward + backward. The default shape is
small so the GPU finishes each call before Python has issued the next one: the time per call is then the
host's. ``wall_us`` (with the GPU waited for) far above ``host_us`` means the GPU, not the host, bounds it.

    mkdir -p build/probe-before && git archive BEFORE_COMMIT hf_scatter | tar -x -C build/probe-before
    python scripts/probes/probe_experts_host_time.py --src build/probe-before --json before.json
    python scripts/probes/probe_experts_host_time.py --json after.json           # this checkout (--src defaults to it)

The host of a virtualised GPU machine is noisy (runs of one tree differed by up to 30% on the H100 machine):
alternate the trees over several runs and compare minima.

``--layouts`` adds the older analysis: Mixtral vs DBRX expert layouts at the 1.5B training shape, GPU kernel
time and host hot spots per layer (GPU).
"""
import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", default=CHECKOUT,
                   help="source tree whose hf_scatter is measured (default: the checkout holding this script)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--calls", type=int, default=200, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds (median and minimum are reported)")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--layouts", action="store_true", help="also run the Mixtral vs DBRX layout analysis (GPU)")
    p.add_argument("--before", metavar="SRC", help="A/B mode: alternate runs of the tree SRC (before) and --src "
                                                   "(after), each in its own process, into one --json")
    p.add_argument("--repeats", type=int, default=4, help="A/B mode: runs of each tree (default 4)")
    return p.parse_args()


def import_tree(src: str):
    """Import hf_scatter from ``src`` ahead of any installed copy; returns (module, git description)."""
    src = os.path.abspath(src)
    sys.path.insert(0, src)
    import hf_scatter

    if not os.path.abspath(hf_scatter.__file__).startswith(src + os.sep):
        sys.exit(f"hf_scatter was imported from {hf_scatter.__file__}, not from --src {src}")
    def git(*cmd):
        return subprocess.run(["git", "-C", src, *cmd], capture_output=True, text=True, check=True).stdout.strip()

    try:  # only a checkout's own root counts (an exported tree inside another checkout is not that commit)
        if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.realpath(src):
            raise OSError
        described = git("rev-parse", "HEAD") + (" + uncommitted changes in hf_scatter/"
                                                if git("status", "--porcelain", "--", "hf_scatter") else "")
    except (OSError, subprocess.CalledProcessError):
        described = "not a git checkout (an exported tree?)"
    return hf_scatter, described


def per_call_us(fn, sync, calls: int, rounds: int, warmup: int) -> dict:
    """Median and minimum over rounds of the host issue time per call, and the median wall time with the
    device waited for. The garbage collector is off while timing (its pauses land in random rounds);
    on a shared or virtualised host, compare minima and repeat runs of each tree alternately."""
    for _ in range(warmup):
        fn()
    sync()
    host, wall = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            host.append((t1 - t0) / calls * 1e6)
            wall.append((t2 - t0) / calls * 1e6)
    finally:
        gc.enable()
    return {"host_us": round(statistics.median(host), 2), "host_us_min": round(min(host), 2),
            "wall_us": round(statistics.median(wall), 2)}


def host_time(args, hf_scatter) -> dict:
    import torch

    from hf_scatter.kernels.backend import kernel_path
    from hf_scatter.tiny import tiny_mixtral

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = tiny_mixtral(hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
                         top_k=args.top_k, layers=1, heads=4, kv_heads=2).to(device=device, dtype=dtype)
    hf_scatter.patch_model(model)
    block = model.model.layers[0].mlp
    experts = block.experts
    assert experts.config._experts_implementation == "scattermoe", experts.config._experts_implementation
    T, H, E, k = args.tokens, args.hidden, args.experts, args.top_k
    x = torch.randn(1, T, H, device=device, dtype=dtype)
    gates, idx = torch.softmax(torch.randn(T, E, device=device), -1).topk(k, -1)
    gates = (gates / gates.sum(-1, keepdim=True)).to(dtype)
    x2, xg = x.view(T, H), x.detach().clone().requires_grad_(True)
    x2g, gates_g = xg.view(T, H), gates.detach().clone().requires_grad_(True)
    dy = torch.randn_like(x)
    leaves = list(block.parameters()) + [xg, gates_g]

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    def fwd_bwd(fn, grad):
        def run():
            fn().backward(grad)
            for t in leaves:  # as an optimizer's zero_grad(set_to_none=True) would
                t.grad = None
        return run

    variants = {
        "experts_fwd": no_grad(lambda: experts(x2, idx, gates)),
        "experts_fwd_bwd": fwd_bwd(lambda: experts(x2g, idx, gates_g), dy.view(T, H)),
        "moe_block_fwd": no_grad(lambda: block(x)),
        "moe_block_fwd_bwd": fwd_bwd(lambda: block(xg), dy),
    }
    assert not torch.autograd.profiler._is_profiler_enabled
    results = {}
    for name, fn in variants.items():
        results[name] = per_call_us(fn, sync, args.calls, args.rounds, args.warmup)
        r = results[name]
        flag = "  (wall >> host: the device bounds this, shrink the shape)" if r["wall_us"] > 1.5 * r["host_us"] else ""
        print(f"{name:20s} host {r['host_us']:9.1f} us/call (min {r['host_us_min']:9.1f})  wall {r['wall_us']:9.1f} "
              f"us/call{flag}", flush=True)
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "kernel_path": kernel_path(device), "dtype": str(dtype).removeprefix("torch."),
            "shape": {"tokens": T, "hidden": H, "intermediate": args.intermediate, "experts": E, "top_k": k},
            "calls": args.calls, "rounds": args.rounds, "results": results}


def layouts() -> None:
    """Mixtral vs DBRX expert layouts at the 1.5B training shape: GPU kernel time vs host time per layer."""
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile
    from triton.testing import do_bench

    from hf_scatter.bench.moe import routed_batch
    from hf_scatter.kernels.swiglu import swiglu, swiglu_pair
    from hf_scatter.moe import expert_mlp

    T, H, I, E, k = 8192, 1024, 3584, 8, 2
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    x, idx, gates, dy = routed_batch(T, H, E, k, dev, dt)
    x, gates = x.requires_grad_(True), gates.to(dt).requires_grad_(True)
    gate_up = (torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H ** -0.5).requires_grad_(True)  # Mixtral
    down = (torch.randn(E, H, I, device=dev, dtype=dt) * I ** -0.5).requires_grad_(True)
    w1 = (torch.randn(E * I, H, device=dev, dtype=dt) * H ** -0.5).requires_grad_(True)  # DBRX
    v1 = (torch.randn(E * I, H, device=dev, dtype=dt) * H ** -0.5).requires_grad_(True)
    w2 = (torch.randn(E * I, H, device=dev, dtype=dt) * I ** -0.5).requires_grad_(True)
    variants = {
        "mixtral": lambda: expert_mlp(x, (gate_up.transpose(1, 2),), down.transpose(1, 2), idx, gates,
                                      lambda h: swiglu(h, True), validate=False),
        "dbrx": lambda: expert_mlp(x, (w1.view(E, I, H).transpose(1, 2), v1.view(E, I, H).transpose(1, 2)),
                                   w2.view(E, I, H), idx, gates, lambda g, u: swiglu_pair(g, u, True), validate=False),
    }
    leaves = [x, gates, gate_up, down, w1, v1, w2]
    for name, fn in variants.items():
        with torch.no_grad():
            fwd = do_bench(fn, warmup=50, rep=300, return_mode="median")
        fb = do_bench(lambda: fn().backward(dy), warmup=50, rep=300, grad_to_none=leaves, return_mode="median")
        print(f"{name:22s} fwd {fwd:7.2f} ms  fwd+bwd {fb:7.2f} ms", flush=True)
    for name, fn in variants.items():
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn().backward(dy)
            torch.cuda.synchronize()
        print("==", name)
        rows = sorted(((e.key[:70], e.self_device_time_total / 3e3, e.count // 3) for e in prof.key_averages()
                       if e.self_device_time_total > 0), key=lambda r: -r[1])
        for key, ms, n in rows[:10]:
            print(f"  {ms:7.3f} ms x{n:<2d} {key}")
    for name, fn in variants.items():  # where the Python time of one fwd+bwd goes
        for _ in range(3):
            fn().backward(dy)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn().backward(dy)
        cpu_ms = (time.perf_counter() - t0) / 20 * 1e3  # host time to issue (async, unless something syncs)
        torch.cuda.synchronize()
        print(f"== {name}: host issue time {cpu_ms:.2f} ms per fwd+bwd")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            fn().backward(dy)
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def compare(args) -> dict:
    """Runs of the two trees alternate (before, after, before, ...), each a fresh process, so slow phases of a
    shared host fall on both; per variant the best round of each tree is compared."""
    import tempfile

    shape = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in
             ("tokens", "hidden", "intermediate", "experts", "top_k", "calls", "rounds", "warmup", "device", "dtype")
             if getattr(args, name) is not None]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for tree, src in (("before", args.before), ("after", args.src)):
                path = os.path.join(tmp, f"{tree}{i}.json")
                subprocess.run([sys.executable, __file__, "--src", src, "--json", path, *shape], check=True)
                with open(path) as f:
                    runs.append({"tree": tree, **json.load(f)})
    variants = list(runs[0]["results"])
    summary = {}
    for name in variants:
        best = {tree: min(r["results"][name]["host_us_min"] for r in runs if r["tree"] == tree)
                for tree in ("before", "after")}
        summary[name] = {"before_host_us_min": best["before"], "after_host_us_min": best["after"],
                         "after_over_before": best["after"] / best["before"]}
        print(f"{name:20s} before {best['before']:9.1f} us  after {best['after']:9.1f} us  "
              f"after/before {best['after'] / best['before']:.3f}", flush=True)
    return {"command": "python scripts/probes/probe_experts_host_time.py --before SRC --src SRC --json FILE",
            "device": runs[0]["device"], "shape": runs[0]["shape"], "repeats": args.repeats,
            "before": {"src": os.path.abspath(args.before), "git": runs[0]["git"]},
            "after": {"src": os.path.abspath(args.src), "git": runs[1]["git"]},
            "summary": summary, "runs": runs}


def main():
    args = parse_args()
    if args.before:
        out = compare(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
            print(f"wrote {args.json}")
        return
    hf_scatter, git = import_tree(args.src)
    import torch

    print(f"hf_scatter from {os.path.dirname(hf_scatter.__file__)} ({git}); torch {torch.__version__}", flush=True)
    out = {"src": os.path.abspath(args.src), "git": git, "torch": torch.__version__,
           "python": platform.python_version(), **host_time(args, hf_scatter)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.layouts:
        layouts()


if __name__ == "__main__":
    main()
