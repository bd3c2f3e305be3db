"""The `hf-scatter` command line."""

from __future__ import annotations

import argparse
import math
import os
import sys

from . import __version__


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit status 2, before any work starts."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line naming it (not the whole usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _write_json(path: str, report: dict) -> None:
    """Atomically: a reader never sees half a file."""
    import json

    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=float)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- argument checks
def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _eval_limit(text: str) -> int | float:
    """lm-eval's --limit: a document count (>= 1) or a share of each task (0 < fraction < 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if 0 < value < 1:
        return value
    if value >= 1 and value == int(value):
        return int(value)
    raise argparse.ArgumentTypeError(f"must be a document count >= 1 or a fraction between 0 and 1, got {text!r}")


def _byte_size(text: str) -> str:
    """Checked here, kept as written: the callers parse it again and print it in their reports."""
    from .offload.units import parse_bytes

    try:
        parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _prompt_lengths(text: str) -> list[float]:
    lengths = []
    for part in (p.strip() for p in text.split(",")):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a length: give a number of tokens, or several "
                                             f"separated by commas (e.g. 512 or 128,512,2048)") from None
        if not (math.isfinite(value) and value >= 1):
            raise argparse.ArgumentTypeError(f"prompt lengths must be at least 1 token, got {part!r}")
        lengths.append(value)
    return lengths


def _torch_device(text: str) -> str:
    """cpu, cuda or cuda:N that exists on this machine."""
    import re

    import torch

    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N")
    if text.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(text.partition(":")[2] or 0)
        if index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count or 'no'} CUDA GPU(s)"
                                             + ("; use --device cpu" if not count else ""))
    return text


def _check_outputs(**paths: str | None) -> None:
    """Each output file can be written (its folder exists and is writable, it is not a folder), checked
    before any measurement or model load so a typo costs seconds, not the run."""
    for option, path in paths.items():
        if not path:
            continue
        flag = "--" + option.replace("_", "-")
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise UsageError(f"{flag} {path}: is a directory; give a file name")
        if not os.path.isdir(parent):
            raise UsageError(f"{flag} {path}: the folder {parent} does not exist")
        if not _can_create_in(parent):
            raise UsageError(f"{flag} {path}: cannot write into {parent}")


def _can_create_in(folder: str) -> bool:
    """Outputs are written as a temporary file renamed into place: try exactly that (permission bits do not
    tell for root, read-only mounts or /proc)."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hf-scatter-probe-"):
            return True
    except OSError:
        return False


def _check_workdir(path: str | None) -> None:
    if path and not (os.path.isdir(path) and _can_create_in(path)):
        raise UsageError(f"--workdir {path}: not a writable folder")


def _cmd_env(args: argparse.Namespace) -> int:
    from .env import environment_report, format_report

    print(format_report(environment_report()))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(quick=args.quick)


# Each suite: run(...) -> report, to_markdown(report), plot(report, path). Only `convert` runs without a GPU.
_BENCH_SUITES = ("moe", "train", "norms", "convert", "bert", "serve", "offload")
_CPU_SUITES = ("convert",)


def _measure(suite, args: argparse.Namespace) -> dict:
    name = args.suite
    if name in ("moe", "norms", "bert", "serve"):
        return suite.run(args.configs)
    if name == "convert":
        return suite.run(layers=args.layers or 2, workdir=args.workdir)
    if name == "offload":
        return suite.run(layers=args.layers or 12, new_tokens=args.new_tokens, requests=args.requests,
                         gpu_memory=args.gpu_memory, profile=args.profile, trace=args.trace,
                         validate_tokens=args.validate_tokens)
    return suite.run(args.configs or list(suite.IMPLS), steps=args.steps, breakdown=not args.no_breakdown)


def _read_report(path: str) -> dict:
    import json

    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise UsageError(f"--replot {path}: {e.strerror.lower()}") from None
    except ValueError as e:
        raise UsageError(f"--replot {path}: not a JSON report ({e})") from None


def _cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    from .bench.timing import BenchUnavailable, require_cuda

    suite = importlib.import_module(f".bench.{args.suite}", __package__)
    _check_outputs(out=args.out, plot=args.plot, trace=args.trace)
    _check_workdir(args.workdir)
    if args.replot:
        report = _read_report(args.replot)
    else:
        if args.profile and args.suite == "offload":
            _check_profile(args.profile)
        try:
            if args.suite not in _CPU_SUITES:
                require_cuda()
            report = _measure(suite, args)
        except BenchUnavailable as e:
            raise UsageError(str(e)) from None
    if args.out:
        _write_json(args.out, report)
    if args.plot:
        suite.plot(report, args.plot)
    print(suite.to_markdown(report))
    return 0


def _check_profile(ref: str) -> None:
    from .offload import load_profile

    try:
        load_profile(ref)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--profile: {e}") from None


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
        raise UsageError(str(e)) from None
    plan = result.plan
    print(f"wrote {args.dst}: {sum(len(t) for t in plan.shards.values())} tensors in {len(plan.shards)} shard(s), "
          f"{plan.total_bytes / 1e9:.3f} GB in {result.seconds:.1f} s ({result.gb_per_s:.2f} GB/s)")
    if result.max_abs_diff is not None:
        print(f"verify: max abs logits difference {result.max_abs_diff:.3g} (patched {args.dst if args.to == 'hf-scatter' else args.src} "
              f"vs vanilla {args.src if args.to == 'hf-scatter' else args.dst})")
    return 0


def _split(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def _cmd_eval(args: argparse.Namespace) -> int:
    """Exit status: 0 parity holds, 1 a tolerance was exceeded, 2 bad input, 3 the run itself failed."""
    import contextlib
    import traceback

    from .eval.random_checkpoint import temporary_random_checkpoint
    from .eval.report import plot, to_markdown
    from .eval.runner import ParityError, run_parity

    if (args.model is None) == (args.random is None):
        raise UsageError("give a checkpoint with --model DIR, or --random SHAPE")
    _check_outputs(out=args.out, plot=args.plot)
    _check_workdir(args.workdir)
    backends = _split(args.backends)
    device = args.device or ("cuda" if _has_cuda() else "cpu")
    if "offloaded" in (backends or []) and device.startswith("cuda"):
        _check_profile(args.profile)  # planning the offloaded run needs one: say so before the first model loads
    try:
        with contextlib.ExitStack() as stack:
            model, described = args.model, None
            if args.random:
                import torch

                big = args.random == "mixtral-8x7b"
                dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if big else "float32")
                model, described = stack.enter_context(temporary_random_checkpoint(
                    args.random, args.random_layers, getattr(torch, dtype), device, args.workdir))
            report = run_parity(model, tasks=_split(args.tasks), backends=backends, dtype=args.dtype,
                                device=args.device, limit=args.limit, batch_size=args.batch_size,
                                tokenizer=args.tokenizer, include_path=args.include_path,
                                builtin_tasks=args.builtin_tasks, tolerance=args.tolerance,
                                ll_tolerance=args.ll_tolerance, max_length=args.max_length,
                                gpu_memory=args.gpu_memory, profile=args.profile)
            if described:
                report["model"] = described
    except ParityError as e:
        raise UsageError(str(e)) from None
    except Exception as e:  # exit 1 means "parity failed" and nothing else
        traceback.print_exc()
        print(f"hf-scatter eval: error: the run failed before a verdict ({type(e).__name__}: {e})", file=sys.stderr)
        return 3
    if args.out:
        _write_json(args.out, report)
    if args.plot:
        plot(report, args.plot)
    print(to_markdown(report))
    return 0 if report["passed"] else 1


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cmd_profile(args: argparse.Namespace) -> int:
    from .bench.timing import markdown_table
    from .offload.profile import default_profile_path, measure_profile

    _check_outputs(out=args.out)
    profile = measure_profile(quick=args.quick, progress=not args.no_progress)
    path = profile.save(args.out)
    print(markdown_table(["quantity", "value", "source"], profile.summary_rows()))
    if "gpu" in profile.notes:
        print(f"\nnote: {profile.notes['gpu']}")
    if os.path.abspath(path) == os.path.abspath(default_profile_path(profile.host, profile.device)):
        print(f"\nsaved {path} (`hf-scatter plan` finds it for this host and device)")
    else:
        print(f"\nsaved {path} (use it with `hf-scatter plan --profile {path}`)")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from .offload import ModelSpec, PlanError, Workload, load_profile, plot_roofline, search_policy
    from .offload.hrm import HierarchicalRoofline

    _check_outputs(out=args.out, plot=args.plot)
    try:
        profile = load_profile(args.profile)
        if args.gpu:
            profile = profile.with_gpu(args.gpu)
        model = ModelSpec.from_config(args.model)
        prompts = args.prompt_len
        workload = Workload.from_prompts(prompts[0] if len(prompts) == 1 else prompts, args.gen_len,
                                         args.num_requests)
        gpu_memory = args.gpu_memory or profile.gpu_memory
        if gpu_memory is None:
            raise PlanError(f"profile {profile.name!r} has no GPU memory: pass --gpu-memory, e.g. 16GiB")
        hrm = HierarchicalRoofline(profile)
        policy = search_policy(model, hrm, workload, gpu_memory, args.cpu_memory)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
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
    parser = _Parser(prog="hf-scatter", description=__doc__)
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
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST if it is a checkpoint (config.json + safetensors, or an earlier "
                        "conversion; anything else is refused), only after the new one is complete")
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
    p.add_argument("--random-layers", type=_positive_int, default=2, help="--random: number of layers (default 2)")
    p.add_argument("--tasks", help="comma-separated lm-eval tasks or groups (default: hfs_all, the bundled suite)")
    p.add_argument("--backends", default="vanilla,patched",
                   help="comma-separated, the first is the reference: vanilla, patched, eager (transformers' eager "
                        "experts: a noise floor), offloaded (default vanilla,patched)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="load dtype (default: the checkpoint's)")
    p.add_argument("--device", type=_torch_device, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--limit", type=_eval_limit,
                   help="documents per task (a fraction below 1: that share of each task)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="requests per forward (default 8)")
    p.add_argument("--max-length", type=_positive_int, help="longest sequence (default: the model's positions)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="your own lm-eval task YAML directory (repeatable)")
    p.add_argument("--builtin-tasks", action="store_true",
                   help="also index lm-eval's own tasks (their datasets must already be in the local cache)")
    p.add_argument("--tolerance", type=_non_negative_float, default=0.006,
                   help="largest aggregated-metric error: absolute, relative for perplexities (default 0.006)")
    p.add_argument("--ll-tolerance", type=_non_negative_float,
                   help="largest per-request log-likelihood difference (default: reported, not enforced)")
    p.add_argument("--workdir", help="--random: where the checkpoint is written (default: the temp dir)")
    p.add_argument("--gpu-memory", type=_byte_size, default="16GiB", help="offloaded backend: GPU memory budget (default 16GiB)")
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
    p.add_argument("--steps", type=_positive_int, default=10, help="train: timed steps after 3 warm-up steps")
    p.add_argument("--no-breakdown", action="store_true", help="train: skip the per-category time breakdown")
    p.add_argument("--layers", type=_positive_int, help="convert / offload: layers of the Mixtral-8x7B-shaped model "
                                              "(default 2 / 12)")
    p.add_argument("--new-tokens", type=_positive_int, default=128, help="offload: tokens generated per request")
    p.add_argument("--requests", type=_positive_int, default=1024, help="offload: number of MTBench-like requests")
    p.add_argument("--gpu-memory", type=_byte_size, default="16GiB", help="offload: GPU memory budget of both systems")
    p.add_argument("--profile", help="offload: hardware profile for the HRM (a known name or JSON; default: "
                                     "measured at the start of the run)")
    p.add_argument("--trace", help="offload: write the Chrome trace of the measured run here")
    p.add_argument("--validate-tokens", type=_int_at_least(0), default=16,
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
    p.add_argument("--gpu-memory", type=_byte_size, help="GPU memory budget, e.g. 16GiB (default: the profile's GPU memory)")
    p.add_argument("--cpu-memory", type=_byte_size, help="CPU memory budget, e.g. 200GiB (default: 90%% of the profile's)")
    p.add_argument("--prompt-len", type=_prompt_lengths, default="512", help="mean prompt length, or comma-separated lengths (default 512)")
    p.add_argument("--gen-len", type=_positive_int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--num-requests", type=_positive_int, help="requests in the workload (caps the batch size)")
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
    try:
        return args.func(args)
    except UsageError as e:
        message = " ".join(str(e).split())  # one line, even where a library's message spans several
        print(f"hf-scatter {args.command}: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # Every command writes its outputs atomically at the end (convert removes its temporary directory
        # on the way out), so an interrupted command has written nothing. SIGTERM arrives as a subclass.
        print(f"hf-scatter {args.command}: {getattr(e, 'verb', 'interrupted')}, nothing written", file=sys.stderr)
        return getattr(e, "exit_status", 130)


if __name__ == "__main__":
    sys.exit(main())
