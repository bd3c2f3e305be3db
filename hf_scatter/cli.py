"""The `hf-scatter` command line."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__


def _write_json(path: str, report: dict) -> None:
    """Atomically: a reader never sees half a file."""
    import json

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=float)
    os.replace(tmp, path)


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import environment_report, format_report

    print(format_report(environment_report()))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(quick=args.quick)


def _cmd_bench(args: argparse.Namespace) -> int:
    import json

    if args.suite == "moe":
        from .bench import moe as suite

        measure = lambda: suite.run(args.configs)  # noqa: E731
    elif args.suite == "norms":
        from .bench import norms as suite

        measure = lambda: suite.run(args.configs)  # noqa: E731
    elif args.suite in ("bert", "serve"):
        import importlib

        suite = importlib.import_module(f".bench.{args.suite}", __package__)
        measure = lambda: suite.run(args.configs)  # noqa: E731
    elif args.suite == "convert":
        from .bench import convert as suite

        measure = lambda: suite.run(layers=args.layers or 2, workdir=args.workdir)  # noqa: E731
    elif args.suite == "offload":
        from .bench import offload as suite

        measure = lambda: suite.run(layers=args.layers or 12, new_tokens=args.new_tokens,  # noqa: E731
                                    requests=args.requests, gpu_memory=args.gpu_memory, profile=args.profile,
                                    trace=args.trace, validate_tokens=args.validate_tokens)
    else:
        from .bench import train as suite

        impls = args.configs or list(suite.IMPLS)
        measure = lambda: suite.run(impls, steps=args.steps, breakdown=not args.no_breakdown)  # noqa: E731
    if args.replot:
        with open(args.replot) as f:
            report = json.load(f)
    else:
        report = measure()
    if args.out:
        _write_json(args.out, report)
    if args.plot:
        suite.plot(report, args.plot)
    print(suite.to_markdown(report))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from .conversion import ConversionError, build_plan, convert

    options = dict(to=args.to, dtype=args.dtype, max_shard_size=args.max_shard_size, hf_naming=args.hf_naming,
                   overwrite=args.overwrite)
    try:
        if args.dry_run:
            print(build_plan(args.src, args.dst, **options).describe())
            return 0
        result = convert(args.src, args.dst, verify=args.verify, progress=not args.no_progress, **options)
    except ConversionError as e:
        print(f"hf-scatter convert: error: {e}", file=sys.stderr)
        return 2
    plan = result.plan
    print(f"wrote {args.dst}: {sum(len(t) for t in plan.shards.values())} tensors in {len(plan.shards)} shard(s), "
          f"{plan.total_bytes / 1e9:.3f} GB in {result.seconds:.1f} s ({result.gb_per_s:.2f} GB/s)")
    if result.max_abs_diff is not None:
        print(f"verify: max abs logits difference {result.max_abs_diff:.3g} (patched {args.dst if args.to == 'hf-scatter' else args.src} "
              f"vs vanilla {args.src if args.to == 'hf-scatter' else args.dst})")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import contextlib

    from .eval.random_checkpoint import temporary_random_checkpoint
    from .eval.report import plot, to_markdown
    from .eval.runner import ParityError, run_parity

    if (args.model is None) == (args.random is None):
        print("hf-scatter eval: error: give a checkpoint with --model DIR, or --random SHAPE", file=sys.stderr)
        return 2
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()] if s else None  # noqa: E731
    try:
        with contextlib.ExitStack() as stack:
            model, described = args.model, None
            if args.random:
                import torch

                big = args.random == "mixtral-8x7b"
                dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if big else "float32")
                device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
                model, described = stack.enter_context(temporary_random_checkpoint(
                    args.random, args.random_layers, getattr(torch, dtype), device, args.workdir))
            report = run_parity(model, tasks=split(args.tasks), backends=split(args.backends), dtype=args.dtype,
                                device=args.device, limit=args.limit, batch_size=args.batch_size,
                                tokenizer=args.tokenizer, include_path=args.include_path,
                                builtin_tasks=args.builtin_tasks, tolerance=args.tolerance,
                                ll_tolerance=args.ll_tolerance, max_length=args.max_length,
                                gpu_memory=args.gpu_memory, profile=args.profile)
            if described:
                report["model"] = described
    except ParityError as e:
        print(f"hf-scatter eval: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        _write_json(args.out, report)
    if args.plot:
        plot(report, args.plot)
    print(to_markdown(report))
    return 0 if report["passed"] else 1


def _cmd_profile(args: argparse.Namespace) -> int:
    from .bench.timing import markdown_table
    from .offload.profile import measure_profile

    profile = measure_profile(quick=args.quick, progress=not args.no_progress)
    path = profile.save(args.out)
    print(markdown_table(["quantity", "value", "source"], profile.summary_rows()))
    if "gpu" in profile.notes:
        print(f"\nnote: {profile.notes['gpu']}")
    print(f"\nsaved {path} (`hf-scatter plan` finds it for this host and device)")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from .offload import ModelSpec, PlanError, Workload, load_profile, plot_roofline, search_policy
    from .offload.hrm import HierarchicalRoofline

    try:
        profile = load_profile(args.profile)
        if args.gpu:
            profile = profile.with_gpu(args.gpu)
        model = ModelSpec.from_config(args.model)
        prompts = [float(p) for p in str(args.prompt_len).split(",") if p.strip()]
        workload = Workload.from_prompts(prompts[0] if len(prompts) == 1 else prompts, args.gen_len,
                                         args.num_requests)
        gpu_memory = args.gpu_memory or profile.gpu_memory
        if gpu_memory is None:
            raise PlanError(f"profile {profile.name!r} has no GPU memory: pass --gpu-memory, e.g. 16GiB")
        hrm = HierarchicalRoofline(profile)
        policy = search_policy(model, hrm, workload, gpu_memory, args.cpu_memory)
    except (ValueError, FileNotFoundError) as e:
        print(f"hf-scatter plan: error: {e}", file=sys.stderr)
        return 2
    print(model.describe() + "\n")
    print(policy.to_markdown() + "\n")
    print(policy.explain())
    if args.out:
        report = {"model": model.to_dict(), "workload": vars(workload), "profile": profile.to_dict(),
                  "turning_points": hrm.turning_points().to_dict(), "policy": policy.to_dict()}
        _write_json(args.out, report)
    if args.plot:
        print(f"\nwrote {plot_roofline(policy, model, hrm, args.plot)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-scatter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hf-scatter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("env", help="print versions, the device and which kernel path is active")
    p.set_defaults(func=_cmd_env)

    p = sub.add_parser("demo", help="patch tiny Mixtral/DBRX/BERT models and check them against vanilla (offline)")
    p.add_argument("--quick", action="store_true", help="smaller shapes, for a fast smoke run")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("convert", help="convert a Mixtral/DBRX safetensors checkpoint to the hf-scatter layout "
                                       "(or back with --to hf)")
    p.add_argument("src", help="checkpoint directory (config.json + safetensors, single file or sharded)")
    p.add_argument("dst", help="output directory; written elsewhere first and renamed into place when complete")
    p.add_argument("--to", choices=["hf-scatter", "hf"], default="hf-scatter", help="target layout")
    p.add_argument("--hf-naming", choices=["per_expert", "fused"],
                   help="--to hf, Mixtral: per-expert hub keys or transformers' fused names (default: the "
                        "naming the checkpoint was converted from)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="cast floating-point tensors")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST (only after success)")
    p.add_argument("--verify", action="store_true",
                   help="before DST is put in place, load it patched and SRC vanilla and compare logits on "
                        "random tokens (CPU; needs memory for one model at a time)")
    p.add_argument("--dry-run", action="store_true", help="check the input and print the plan; write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("eval", help="lm-eval parity: the same checkpoint vanilla vs hf-scatter, metric by metric and "
                                    "request by request (offline; exit 1 past a tolerance)")
    p.add_argument("--model", help="checkpoint directory: Mixtral / DBRX / BERT family, HF or hf-scatter layout")
    p.add_argument("--random", choices=["mixtral-8x7b", "tiny-mixtral", "tiny-dbrx", "tiny-bert"],
                   help="instead of --model: a random-weight checkpoint of this shape, saved to a temp dir first")
    p.add_argument("--random-layers", type=int, default=2, help="--random: number of layers (default 2)")
    p.add_argument("--tasks", help="comma-separated lm-eval tasks or groups (default: hfs_all, the bundled suite)")
    p.add_argument("--backends", default="vanilla,patched",
                   help="comma-separated, the first is the reference: vanilla, patched, eager (transformers' eager "
                        "experts: a noise floor), offloaded (default vanilla,patched)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="load dtype (default: the checkpoint's)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--limit", type=lambda s: float(s) if "." in s else int(s),
                   help="documents per task (a fraction below 1: that share of each task)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward (default 8)")
    p.add_argument("--max-length", type=int, help="longest sequence (default: the model's positions)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="your own lm-eval task YAML directory (repeatable)")
    p.add_argument("--builtin-tasks", action="store_true",
                   help="also index lm-eval's own tasks (their datasets must already be in the local cache)")
    p.add_argument("--tolerance", type=float, default=0.006,
                   help="largest aggregated-metric error: absolute, relative for perplexities (default 0.006)")
    p.add_argument("--ll-tolerance", type=float,
                   help="largest per-request log-likelihood difference (default: reported, not enforced)")
    p.add_argument("--workdir", help="--random: where the checkpoint is written (default: the temp dir)")
    p.add_argument("--gpu-memory", default="16GiB", help="offloaded backend: GPU memory budget (default 16GiB)")
    p.add_argument("--profile", help="offloaded backend: hardware profile, a known name or JSON (default: this "
                                     "machine's saved one from `hf-scatter profile`)")
    p.add_argument("--out", help="write the full report as JSON here")
    p.add_argument("--plot", help="draw every request's log-likelihood difference into this PNG")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("bench", help="GPU benchmarks against every peer in one process (JSON + Markdown)")
    p.add_argument("suite", choices=["moe", "train", "norms", "convert", "bert", "serve", "offload"],
                   help="moe: one SMoE SwiGLU layer vs HF eager/grouped_mm/batched_mm/dense; "
                        "train: training steps of the paper's 1.5B Mixtral (and a same-shape DBRX), vanilla vs patched; "
                        "norms: fused LayerNorm/RMSNorm/softmax/router vs torch, GB/s against the copy roof, "
                        "and BERT-base forward; convert: conversion GB/s and CPU load time, HF vs hf-scatter layout (no GPU needed); "
                        "bert: packed BERT-base inference vs padded SDPA (latency, throughput, memory); "
                        "serve: Poisson-arrival serving, no batching / naive / DP batching, vanilla vs packed; "
                        "offload: Mixtral-8x7B-shaped offloaded generation, CGOPipe vs HF accelerate offload vs "
                        "the HRM prediction")
    p.add_argument("--configs", nargs="*", help="subset of configs (moe) or implementations (train); default: all")
    p.add_argument("--steps", type=int, default=10, help="train: timed steps after 3 warm-up steps")
    p.add_argument("--no-breakdown", action="store_true", help="train: skip the per-category time breakdown")
    p.add_argument("--layers", type=int, help="convert / offload: layers of the Mixtral-8x7B-shaped model "
                                              "(default 2 / 12)")
    p.add_argument("--new-tokens", type=int, default=128, help="offload: tokens generated per request")
    p.add_argument("--requests", type=int, default=1024, help="offload: number of MTBench-like requests")
    p.add_argument("--gpu-memory", default="16GiB", help="offload: GPU memory budget of both systems")
    p.add_argument("--profile", help="offload: hardware profile for the HRM (a known name or JSON; default: "
                                     "measured at the start of the run)")
    p.add_argument("--trace", help="offload: write the Chrome trace of the measured run here")
    p.add_argument("--validate-tokens", type=int, default=16,
                   help="offload: new tokens of each HRM validation policy (per-layer decode time, predicted vs "
                        "measured); 0 skips them")
    p.add_argument("--workdir", help="convert: where the checkpoints are written (default: the temp dir)")
    p.add_argument("--out", help="write the full results as JSON here")
    p.add_argument("--plot", help="draw time and memory bars into this PNG")
    p.add_argument("--replot", metavar="JSON", help="re-render table/plot from a saved JSON instead of measuring")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("profile", help="measure this machine's roofs for the offload planner (GPU, CPU, PCIe; "
                                       "under a minute) and save them as JSON")
    p.add_argument("--out", help="JSON file (default: ~/.cache/hf_scatter/profiles/<host>__<device>.json)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer points (a few seconds)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("plan", help="offloaded generation: best policy (batch, micro-batch, placement, resident "
                                    "fractions) from the hierarchical roofline model, as a table and a plot")
    p.add_argument("--model", required=True,
                   help="built-in name (mixtral-8x7b, mixtral-8x22b, dbrx, llama-3-8b), a config.json or a model "
                        "directory")
    p.add_argument("--gpu-memory", help="GPU memory budget, e.g. 16GiB (default: the profile's GPU memory)")
    p.add_argument("--cpu-memory", help="CPU memory budget, e.g. 200GiB (default: 90%% of the profile's)")
    p.add_argument("--prompt-len", default="512", help="mean prompt length, or comma-separated lengths (default 512)")
    p.add_argument("--gen-len", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--num-requests", type=int, help="requests in the workload (caps the batch size)")
    p.add_argument("--profile", help="profile JSON or a known name (h100-host-anchors); default: the saved profile "
                                     "of this host and device")
    p.add_argument("--gpu", help="plan for this GPU on the profile's host (spec-sheet peaks): t4, l4, a100-40gb, "
                                 "h100-pcie")
    p.add_argument("--out", help="write model, profile, turning points and policy as JSON here")
    p.add_argument("--plot", help="draw the hierarchical roofline with the chosen operating points into this PNG")
    p.set_defaults(func=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        # The demo checks the kernels themselves: on a machine without a GPU, run them interpreted.
        os.environ.setdefault("HF_SCATTER_KERNELS", "triton")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # Every command writes its outputs atomically at the end (convert removes its temporary directory
        # on the way out), so an interrupted command has written nothing.
        print(f"hf-scatter {args.command}: interrupted, nothing written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
