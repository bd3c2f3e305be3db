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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-scatter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hf-scatter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("env", help="print versions, the device and which kernel path is active")
    p.set_defaults(func=_cmd_env)

    p = sub.add_parser("demo", help="patch tiny Mixtral/DBRX/BERT models and check them against vanilla (offline)")
    p.add_argument("--quick", action="store_true", help="smaller shapes, for a fast smoke run")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="GPU benchmarks against every peer in one process (JSON + Markdown)")
    p.add_argument("suite", choices=["moe", "train"],
                   help="moe: one SMoE SwiGLU layer vs HF eager/grouped_mm/batched_mm/dense; "
                        "train: training steps of the paper's 1.5B Mixtral (and a same-shape DBRX), vanilla vs patched")
    p.add_argument("--configs", nargs="*", help="subset of configs (moe) or implementations (train); default: all")
    p.add_argument("--steps", type=int, default=10, help="train: timed steps after 3 warm-up steps")
    p.add_argument("--no-breakdown", action="store_true", help="train: skip the per-category time breakdown")
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
