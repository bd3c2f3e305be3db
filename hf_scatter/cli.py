"""The `hf-scatter` command line."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

from . import __version__
from .common.argtypes import (byte_size, eval_limit, non_negative_float, positive_int, prompt_lengths,
                              torch_device)
from .common.atomic_files import write_json


class UsageError(ValueError):
    """Bad command-line input: printed as one line, exit status 2, before any work starts."""


def _help_list(name: str) -> list[str] | None:
    """The names a help text's ``{name}`` stands for: the tables the commands check their input against, so the
    help cannot drift from them (None: not a list)."""
    if name == "builtin_models":
        from .common.shapes import BUILTIN_MODELS as names
    elif name == "planned_families":
        from .offload.families.registry import offloaded_model_types

        names = offloaded_model_types()
    elif name == "convert_families":
        from .conversion.plan import supported_model_types

        names = supported_model_types()
    elif name == "gpus":
        from .offload import GPU_SPECS as names
    elif name == "known_profiles":
        from .offload import KNOWN_PROFILES as names
    else:
        return None
    return list(names)


def _fill_lists(text: str) -> str:
    def names(match: re.Match) -> str:
        found = _help_list(match.group(1))
        return match.group(0) if found is None else ", ".join(found)

    return re.sub(r"\{(\w+)\}", names, text)


class _HelpFormatter(argparse.HelpFormatter):
    """Fills the ``{lists}`` of help texts as help is shown, not when the parser is built: listing the registry's
    families imports every family's transformers code, seconds that every command would wait for. Names stay
    whole on wrapping (argparse breaks mixtral-8x7b at its hyphen)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(_fill_lists(text).split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(_fill_lists(text), width, indent)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line naming it (not the whole usage block), exit status 2, and under the
    name of the command it was given to (``hf-scatter plan: error: ...``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self._has_commands = False

    def add_subparsers(self, **kwargs):
        self._has_commands = True
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not self._has_commands:  # else argparse reports a command's stray option as the top level's
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


_BENCH_OPTIONS = ("out", "plot", "replot")  # every suite's; the rest of a bench command's flags are the suite's


def _read_report(path: str, suite, name: str) -> tuple[dict, str]:
    """A saved report of ``suite`` and its table, rendered here once: another suite's report (or any other JSON)
    is refused in one line instead of a traceback from the table or the plot."""
    import json

    try:
        with open(path) as f:
            report = json.load(f)
    except OSError as e:
        raise UsageError(f"--replot {path}: {e.strerror.lower()}") from None
    except ValueError as e:
        raise UsageError(f"--replot {path}: not a JSON report ({e})") from None
    try:
        table = suite.to_markdown(report)
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise UsageError(f"--replot {path}: not a report of `hf-scatter bench {name}` ({type(e).__name__}: {e})") \
            from None
    return report, table


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import suite as bench_suite
    from .bench.availability import BenchUnavailable, RunStopped, require_cuda

    suite = bench_suite(args.suite)
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "suite", "func", *_BENCH_OPTIONS)}
    _check_outputs(out=args.out, plot=args.plot, trace=flags.get("trace"))
    _check_workdir(flags.get("workdir"))
    table = None
    if args.replot:
        report, table = _read_report(args.replot, suite, args.suite)
    else:
        if flags.get("profile"):
            _load_profile(flags["profile"])
        if hasattr(suite, "check_flags"):
            try:
                suite.check_flags(**flags)
            except ValueError as e:
                raise UsageError(str(e)) from None
        try:
            if suite.NEEDS_GPU:
                require_cuda()
            report = suite.run(**flags)
        except BenchUnavailable as e:
            raise UsageError(str(e)) from None
        except RunStopped as e:  # a run that stopped part-way keeps what it measured
            if e.report is not None:
                if args.out:
                    write_json(args.out, e.report, default=float)
                print(suite.to_markdown(e.report))
            print(f"hf-scatter: error: {e}", file=sys.stderr)
            return 1
        if report is None:  # a rank other than 0 of a distributed run: rank 0 alone writes and prints
            return 0
    if args.out:
        write_json(args.out, report, default=float)
    if args.plot:
        suite.plot(report, args.plot)
    print(table if table is not None else suite.to_markdown(report))
    return 0


def _load_profile(ref: str | None):
    from .offload import load_profile

    try:
        return load_profile(ref)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--profile: {e}") from None
    except TypeError as e:  # JSON that is no profile (a list, a field of the wrong type)
        what = f"--profile {ref}" if ref else "this machine's saved profile"
        raise UsageError(f"{what}: not a hardware profile ({e})") from None


def _model_spec(ref: str, weights: str = "shipped"):
    """A model's shapes from a built-in name, a config.json or a model directory (``--model`` of plan, profile)."""
    from .offload import ModelSpec

    try:
        return ModelSpec.from_config(ref, weights=weights)
    except ValueError as e:
        raise UsageError(f"--model: {e}") from None


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
        patched, vanilla = (args.dst, args.src) if args.to == "hf-scatter" else (args.src, args.dst)
        print(f"verify: max abs logits difference {result.max_abs_diff:.3g} (patched {patched} "
              f"vs vanilla {vanilla})")
    return 0


def _split(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def _cmd_eval(args: argparse.Namespace) -> int:
    """Exit status: 0 parity holds, 1 a tolerance was exceeded, 2 bad input, 3 the run itself failed."""
    import traceback

    from .eval.random_checkpoint import FULL_SIZE, temporary_random_checkpoint
    from .eval.report import plot, to_markdown
    from .eval.runner import ParityError, run_parity

    if args.model is None and args.random is None:  # both at once: argparse's group refuses
        raise UsageError("give a checkpoint with --model DIR, or --random SHAPE")
    _check_outputs(out=args.out, plot=args.plot)
    _check_workdir(args.workdir)
    for flag, folder in [("--tokenizer", args.tokenizer), *(("--include-path", d) for d in args.include_path)]:
        if folder and not os.path.isdir(folder):
            raise UsageError(f"{flag} {folder}: not a folder")
    backends = _split(args.backends)
    if backends:  # before a --random checkpoint is written (gigabytes for the full-size shapes)
        from .eval.backends import BackendUnavailable, resolve

        try:
            resolve(backends)
        except BackendUnavailable as e:
            raise UsageError(str(e) if "--backends" in str(e) else f"--backends {args.backends}: {e}") from None
    device = args.device or ("cuda" if _has_cuda() else "cpu")
    if "offloaded" in (backends or []) and device.startswith("cuda"):
        _load_profile(args.profile)  # planning the offloaded run needs one: say so before the first model loads
    try:
        with contextlib.ExitStack() as stack:
            model, described = args.model, None
            if args.random:
                import torch

                big = args.random in FULL_SIZE
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
        write_json(args.out, report, default=float)
    if args.plot:
        plot(report, args.plot)
    print(to_markdown(report))
    return 0 if report["passed"] else 1


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cmd_profile(args: argparse.Namespace) -> int:
    from .common.markdown import markdown_table
    from .offload import default_profile_path
    from .offload.measure import measure_profile

    _check_outputs(out=args.out)
    shapes = [_model_spec(m) for m in args.model or []]  # before any measuring: a bad model name costs nothing
    profile = measure_profile(quick=args.quick, progress=not args.no_progress, attention_shapes=shapes)
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
    from tqdm import tqdm

    from .offload import PlanError, Workload, plot_roofline, search_policy
    from .offload.plan.hrm import HierarchicalRoofline
    from .offload.plan.policy import gpu_scaling_table
    from .offload.plan.tensor_parallel import check_divisible
    from .offload.runtime.offloaded import CGOPIPE_PLACEMENT

    _check_outputs(out=args.out, plot=args.plot)
    model = _model_spec(args.model, args.weights)  # first: a wrong name needs no profile to be found out
    profile = _load_profile(args.profile)
    try:
        if args.gpu:
            profile = profile.with_gpu(args.gpu)
        prompts = args.prompt_len
        workload = Workload.from_prompts(prompts[0] if len(prompts) == 1 else prompts, args.gen_len,
                                         args.num_requests)
        gpu_memory = args.gpu_memory or profile.gpu_memory
        if gpu_memory is None:
            raise PlanError(f"profile {profile.name!r} has no GPU memory: pass --gpu-memory, e.g. 16GiB")
        if args.plot and len(args.gpus) > 1:
            raise PlanError("--plot draws one plan: give one --gpus count with it")
        placements = [CGOPIPE_PLACEMENT] if args.placement == "cgopipe" else None
        hrms = {gpus: HierarchicalRoofline(profile, gpus) for gpus in args.gpus}  # the host's GPU count, checked
        for gpus in args.gpus:  # and what the model can split, before the first search
            check_divisible(model, gpus)
        plans = {gpus: (hrm, search_policy(model, hrm, workload, gpu_memory, args.cpu_memory, placements=placements,
                                           gpus=gpus))
                 for gpus, hrm in tqdm(hrms.items(), desc="plan", disable=len(hrms) == 1)}
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    print(model.describe() + "\n")
    if model.expert_format:
        print(f"The experts are priced as shipped ({model.expert_format.upper()}), as hf_scatter.offload streams them "
              "from a checkpoint loaded as shipped (a dequantized load: --weights bf16 prices it).\n")
    for gpus, (hrm, policy) in plans.items():
        if len(plans) > 1:
            print(f"## {gpus} GPU{'s' if gpus > 1 else ''}\n")
        print(policy.to_markdown() + "\n")
        print(policy.explain() + "\n")
    if len(plans) > 1:
        print(gpu_scaling_table({gpus: policy for gpus, (_, policy) in plans.items()}))
    if args.out:
        def entry(hrm, policy):
            return {"turning_points": hrm.turning_points().to_dict(), "policy": policy.to_dict(),
                    "uncalibrated": list(hrm.uncalibrated)}
        report = {"model": model.to_dict(), "workload": vars(workload), "profile": profile.to_dict()}
        if len(plans) == 1:
            report.update(entry(*next(iter(plans.values()))))
        else:
            report["by_gpus"] = {str(gpus): entry(hrm, policy) for gpus, (hrm, policy) in plans.items()}
        write_json(args.out, report, default=float)
    if args.plot:
        hrm, policy = next(iter(plans.values()))
        print(f"\nwrote {plot_roofline(policy, model, hrm, args.plot)}")
    return 0


def _command(sub, name: str, summary: str) -> argparse.ArgumentParser:
    """One sub-command, its summary both in ``hf-scatter --help`` and atop its own ``--help``."""
    return sub.add_parser(name, help=summary, description=summary)


def _add_env(sub) -> None:
    p = _command(sub, "env", "print versions, the device and which kernel path is active")
    p.set_defaults(func=_cmd_env)


def _add_demo(sub) -> None:
    p = _command(sub, "demo", "patch tiny Mixtral/DBRX/BERT models and check them against vanilla (offline)")
    p.add_argument("--quick", action="store_true", help="smaller shapes, for a fast smoke run")
    p.set_defaults(func=_cmd_demo)


def _add_convert(sub) -> None:
    p = _command(sub, "convert", "convert a safetensors checkpoint of a family hf-scatter patches ({convert_families}) "
                                 "to the hf-scatter layout (or back with --to hf)")
    p.add_argument("src", help="checkpoint directory (config.json + safetensors, single file or sharded)")
    p.add_argument("dst", help="output directory; written elsewhere first and renamed into place when complete")
    p.add_argument("--to", choices=["hf-scatter", "hf"], default="hf-scatter", help="target layout")
    p.add_argument("--hf-naming", choices=["hub", "fused", "per_expert"],
                   help="--to hf: the hub's naming (what save_pretrained writes: one tensor per expert for "
                        "Mixtral, Qwen-MoE, OLMoE, DeepSeek) or the model's own fused names (default: the naming "
                        "the checkpoint was converted from; per_expert is the old name of hub)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="cast floating-point tensors")
    p.add_argument("--max-shard-size", type=byte_size, default="5GB",
                   help="largest output shard, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing DST if it is a checkpoint (config.json + safetensors, or an earlier "
                        "conversion; anything else is refused), only after the new one is complete")
    p.add_argument("--verify", action="store_true",
                   help="before DST is put in place, load it patched and SRC vanilla and compare logits on "
                        "random tokens (CPU; needs memory for one model at a time)")
    p.add_argument("--dry-run", action="store_true", help="check the input and print the plan; write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)


def _add_eval(sub) -> None:
    from .eval.random_checkpoint import SHAPES as RANDOM_SHAPES

    p = _command(sub, "eval", "lm-eval parity: the same checkpoint vanilla vs hf-scatter, metric by metric and "
                              "request by request (offline; exit 1 past a tolerance)")
    checkpoint = p.add_mutually_exclusive_group()
    checkpoint.add_argument("--model", help="checkpoint directory of a family patch_model runs, HF or hf-scatter "
                                            "layout")
    checkpoint.add_argument("--random", choices=RANDOM_SHAPES, metavar="SHAPE",
                            help="instead of --model: a random-weight checkpoint of this shape, saved to a temp dir "
                                 "first: " + ", ".join(RANDOM_SHAPES))
    p.add_argument("--random-layers", type=positive_int, default=2, help="--random: number of layers (default 2)")
    p.add_argument("--tasks", help="comma-separated lm-eval tasks or groups (default: hfs_all, the bundled suite)")
    p.add_argument("--backends", default="vanilla,patched",
                   help="comma-separated, the first is the reference: vanilla, patched, eager (transformers' eager "
                        "experts: a noise floor), offloaded (default vanilla,patched)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="load dtype (default: the checkpoint's)")
    p.add_argument("--device", type=torch_device, help="cuda, cuda:N or cpu (default: cuda when present)")
    p.add_argument("--limit", type=eval_limit,
                   help="documents per task (a fraction below 1: that share of each task)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="requests per forward (default 8)")
    p.add_argument("--max-length", type=positive_int, help="longest sequence (default: the model's positions)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="your own lm-eval task YAML directory (repeatable)")
    p.add_argument("--builtin-tasks", action="store_true",
                   help="also index lm-eval's own tasks (their datasets must already be in the local cache)")
    p.add_argument("--tolerance", type=non_negative_float, default=0.006,
                   help="largest aggregated-metric error: absolute, relative for perplexities (default 0.006)")
    p.add_argument("--ll-tolerance", type=non_negative_float,
                   help="largest per-request log-likelihood difference (default: reported, not enforced)")
    p.add_argument("--workdir", help="--random: where the checkpoint is written (default: the temp dir)")
    p.add_argument("--gpu-memory", type=byte_size, default="16GiB",
                   help="offloaded backend: GPU memory budget (default 16GiB)")
    p.add_argument("--profile", help="offloaded backend: hardware profile, a known name ({known_profiles}) or JSON "
                                     "(default: this machine's saved one from `hf-scatter profile`)")
    p.add_argument("--out", help="write the full report as JSON here")
    p.add_argument("--plot", help="draw every request's log-likelihood difference into this PNG")
    p.set_defaults(func=_cmd_eval)


def _add_bench(sub) -> None:
    from .bench import SUITES
    from .bench import suite as bench_suite

    p = _command(sub, "bench", "GPU benchmarks against every peer in one process (JSON + Markdown)")
    suites = p.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name, summary in SUITES.items():
        sp = suites.add_parser(name, help=summary, description=summary)
        bench_suite(name).add_arguments(sp.add_argument_group(f"{name} options"))
        sp.add_argument("--out", help="write the full results as JSON here")
        sp.add_argument("--plot", help="draw the results into this PNG")
        sp.add_argument("--replot", metavar="JSON", help="re-render table/plot from a saved JSON instead of measuring")
        sp.set_defaults(func=_cmd_bench)


def _add_profile(sub) -> None:
    p = _command(sub, "profile", "measure this machine's roofs for the offload planner (GPU, CPU, PCIe; under a "
                                 "minute) and save them as JSON")
    p.add_argument("--out", help="JSON file (default: ~/.cache/hf_scatter/profiles/<host>__<device>.json)")
    p.add_argument("--quick", action="store_true", help="smaller sizes and fewer points (a few seconds)")
    p.add_argument("--model", action="append", metavar="NAME_OR_CONFIG",
                   help="also measure CPU attention at this model's shape (query heads per KV head, head size, MLA) "
                        "and, with a GPU, its expert kernels on its own experts; a name or config as `plan --model` "
                        "takes; repeatable; plans for that model then use them")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_profile)


def _add_plan(sub) -> None:
    p = _command(sub, "plan", "offloaded generation: best policy (batch, micro-batch, placement, resident fractions) "
                              "from the hierarchical roofline model, as a table and a plot")
    p.add_argument("--model", required=True,
                   help="built-in name ({builtin_models}), or a config.json or model directory of a decoder: "
                        "{planned_families}, or a dense Llama-style one")
    p.add_argument("--gpu-memory", type=byte_size,
                   help="GPU memory budget, e.g. 16GiB (default: the profile's GPU memory)")
    p.add_argument("--cpu-memory", type=byte_size,
                   help="CPU memory budget, e.g. 200GiB (default: 90%% of the profile's)")
    p.add_argument("--prompt-len", type=prompt_lengths, default="512",
                   help="mean prompt length, or comma-separated lengths (default 512)")
    p.add_argument("--gen-len", type=positive_int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--num-requests", type=positive_int, help="requests in the workload (caps the batch size)")
    p.add_argument("--profile", help="profile JSON, a bench report (the profile it ran on) or a known name "
                                     "({known_profiles}); default: the saved profile of this host and device")
    p.add_argument("--gpu", help="plan for this GPU on the profile's host (spec-sheet peaks): {gpus}")
    p.add_argument("--gpus", type=positive_int, nargs="+", default=[1], metavar="N",
                   help="GPUs of the host as one tensor-parallel group, --gpu-memory on each (default 1); several "
                        "counts plan each and compare them (throughput, scaling, where the bottleneck moves)")
    p.add_argument("--placement", choices=("any", "cgopipe"), default="any",
                   help="any: attention and experts each on the CPU or the GPU, as the HRM finds best (default); "
                        "cgopipe: what hf_scatter.offload runs (attention on the CPU, experts on the GPU)")
    p.add_argument("--weights", choices=("shipped", "bf16", "fp8"), default="shipped",
                   help="shipped: the experts in the checkpoint's own format (GPT-OSS: MXFP4, 4.25 bits a weight; "
                        "a block-scaled FP8 checkpoint: 1 byte; default); bf16: as a dequantized load holds them; "
                        "fp8: as a block-scaled FP8 release of the model holds them (Qwen3-30B-A3B-FP8)")
    p.add_argument("--out", help="write model, profile, turning points and policy as JSON here")
    p.add_argument("--plot", help="draw the hierarchical roofline with the chosen operating points into this PNG")
    p.set_defaults(func=_cmd_plan)


_COMMANDS = (_add_env, _add_demo, _add_convert, _add_eval, _add_bench, _add_profile, _add_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-scatter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"hf-scatter {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
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
