"""The `hf-scatter` command line."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__


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
    elif args.suite == "convert":
        from .bench import convert as suite

        measure = lambda: suite.run(layers=args.layers, workdir=args.workdir)  # noqa: E731
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
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, args.out)
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

    p = sub.add_parser("bench", help="GPU benchmarks against every peer in one process (JSON + Markdown)")
    p.add_argument("suite", choices=["moe", "train", "norms", "convert"],
                   help="moe: one SMoE SwiGLU layer vs HF eager/grouped_mm/batched_mm/dense; "
                        "train: training steps of the paper's 1.5B Mixtral (and a same-shape DBRX), vanilla vs patched; "
                        "norms: fused LayerNorm/RMSNorm/softmax/router vs torch, GB/s against the copy roof, "
                        "and BERT-base forward; convert: conversion GB/s and CPU load time, HF vs hf-scatter layout (no GPU needed)")
    p.add_argument("--configs", nargs="*", help="subset of configs (moe) or implementations (train); default: all")
    p.add_argument("--steps", type=int, default=10, help="train: timed steps after 3 warm-up steps")
    p.add_argument("--no-breakdown", action="store_true", help="train: skip the per-category time breakdown")
    p.add_argument("--layers", type=int, default=2, help="convert: layers of the Mixtral-8x7B-shaped model")
    p.add_argument("--workdir", help="convert: where the checkpoints are written (default: the temp dir)")
    p.add_argument("--out", help="write the full results as JSON here")
    p.add_argument("--plot", help="draw time and memory bars into this PNG")
    p.add_argument("--replot", metavar="JSON", help="re-render table/plot from a saved JSON instead of measuring")
    p.set_defaults(func=_cmd_bench)
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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
