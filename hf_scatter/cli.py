"""The `hf-scatter` command line."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import environment_report, format_report

    print(format_report(environment_report()))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-scatter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hf-scatter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("env", help="print versions, the device and which kernel path is active")
    p.set_defaults(func=_cmd_env)

    p = sub.add_parser("demo", help="patch tiny Mixtral/DBRX/BERT models and check them against vanilla (offline)")
    p.add_argument("--quick", action="store_true", help="smaller shapes, for a fast smoke run")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "demo":
        # Kernels must be defined after this for the interpreter to take them (CPU machines only).
        from .kernels.backend import enable_interpreter_if_no_gpu

        enable_interpreter_if_no_gpu()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
