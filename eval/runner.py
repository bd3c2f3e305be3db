"""Runs lm-eval once per backend on one checkpoint, offline, and hands the outputs to ``compare``.

Everything the user gave is checked before the first model loads (checkpoint directory, tokenizer,
backends, task names), so a typo costs seconds, not a model load. Backends run one after another and
each model is freed before the next loads, so the peak is one model.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

from . import MIN_LM_EVAL
from .backends import BackendUnavailable, LoadSettings, resolve
from .compare import BackendRun, compare, from_lm_eval
from .suite import SUITE, TASKS_DIR

DEFAULT_TOLERANCE = 0.006  # ScatterMoE paper, Table 1: HF vs ScatterMoE on Mixtral 8x7B
_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class ParityError(ValueError):
    """Bad input or environment: the message names the problem and the fix."""


@contextlib.contextmanager
def offline():
    """No hub or dataset downloads for the duration, even from libraries imported earlier."""
    import huggingface_hub.constants as hub

    saved_env = {k: os.environ.get(k) for k in _OFFLINE_ENV}
    saved_hub = hub.HF_HUB_OFFLINE
    os.environ.update(_OFFLINE_ENV)
    hub.HF_HUB_OFFLINE = True  # read at call time by huggingface_hub's HTTP session
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = saved_hub
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _DropCustomDatasetHint(logging.Filter):
    """lm-eval advises ``--metadata`` for every task with a ``custom_dataset``; the bundled loader takes none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


@contextlib.contextmanager
def _quiet_bundled_task_hints():
    logger, hint = logging.getLogger("lm_eval.api.task"), _DropCustomDatasetHint()
    logger.addFilter(hint)
    try:
        yield
    finally:
        logger.removeFilter(hint)


def _check_lm_eval() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        found = version("lm_eval")
    except PackageNotFoundError:
        raise ParityError(f"hf-scatter eval needs lm-eval: pip install 'hf-scatter[eval]' "
                          f"(or 'lm-eval>={MIN_LM_EVAL}')") from None
    if Version(found) < Version(MIN_LM_EVAL):
        raise ParityError(f"hf-scatter eval needs lm-eval >= {MIN_LM_EVAL}, found {found}: "
                          f"pip install -U 'lm-eval>={MIN_LM_EVAL}'")
    return found


def _read_config(model: Path) -> dict:
    if not (model / "config.json").is_file():
        raise ParityError(f"--model {model}: not a checkpoint directory (no config.json); hf-scatter eval "
                          f"evaluates local checkpoints only and never downloads")
    with open(model / "config.json") as f:
        return json.load(f)


def is_masked_lm(config: dict) -> bool:
    """BERT-family encoder checkpoints: scored by pseudo-log-likelihood instead of lm-eval's causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.get("architectures") or [])
    return config.get("model_type") in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not causal \
        and not config.get("is_decoder", False)


def _check_tokenizer(path: Path, encoder: bool) -> None:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises several types for a missing or broken tokenizer
        raise ParityError(f"no usable tokenizer in {path} ({type(e).__name__}: {e}); save one there or pass "
                          f"--tokenizer DIR") from None
    if encoder and tokenizer.mask_token_id is None:
        raise ParityError(f"the tokenizer in {path} has no mask token, which scoring a masked LM needs")


def resolve_tasks(names: list[str], include_path: list[str], builtin_tasks: bool, encoder: bool):
    """Leaf task names to run, the task manager that knows them, and tasks left out (with why)."""
    from lm_eval.tasks import TaskManager

    paths = [str(TASKS_DIR)] + [str(Path(p).resolve()) for p in include_path]
    for p in paths[1:]:
        if not Path(p).is_dir():
            raise ParityError(f"--include-path {p}: not a directory of lm-eval task YAMLs")
    manager = TaskManager(include_path=paths, include_defaults=builtin_tasks)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        hint = "" if builtin_tasks else "; lm-eval's own tasks need --builtin-tasks (and their data in the local cache)"
        bundled = sorted(n for n in manager.all_tasks if n.startswith("hfs_"))
        raise ParityError(f"unknown task(s) {', '.join(unknown)}; bundled: {', '.join(bundled)}{hint}")
    try:
        loaded = manager.load(names)["tasks"]
    except Exception as e:  # a task's YAML or data: name the cause, keep the original below it
        raise ParityError(f"could not load task(s) {', '.join(names)}: {type(e).__name__}: {e} (lm-eval's own "
                          f"tasks need their datasets in the local Hugging Face cache: nothing is downloaded)") from e
    skipped = {}
    if encoder:
        for name, task in loaded.items():
            if task.config.output_type == "generate_until":
                skipped[name] = "a masked LM (encoder) cannot generate"
    leaves = [n for n in loaded if n not in skipped]
    if not leaves:
        raise ParityError(f"nothing left to run: {', '.join(f'{k} ({v})' for k, v in skipped.items())}")
    return leaves, manager, skipped


@contextlib.contextmanager
def _quiet_git_lookup():
    """lm-eval records the working directory's git revision in every run, asking git with its stderr on ours:
    outside a checkout each backend printed "fatal: not a git repository". The same lookup, quiet."""
    import lm_eval.evaluator as evaluator

    from hf_scatter.common.timing import git_revision

    if not hasattr(evaluator, "get_git_commit_hash"):  # another lm-eval layout: nothing to quiet
        yield
        return
    loud, evaluator.get_git_commit_hash = evaluator.get_git_commit_hash, git_revision
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = loud


def _free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def scored_tokens(lm, output_type: str, arguments: tuple) -> int:
    """How many tokens lm-eval sums a log-likelihood request over, tokenized as ``lm`` does: a rolling
    request scores every token of its text, a (context, continuation) request the continuation's."""
    if output_type == "loglikelihood_rolling":
        return len(lm.tok_encode(arguments[0]))
    context, continuation = arguments[:2]
    if not context:  # lm-eval conditions on a prefix token instead
        return len(lm.tok_encode(continuation))
    return len(lm._encode_pair(context, continuation)[1])


def _model_dtype(dtype: str, config: dict) -> str:
    return dtype if dtype != "auto" else str(config.get("dtype") or config.get("torch_dtype") or "float32")


def _run_backend(backend, settings: LoadSettings, tasks: list[str], manager, limit, log,
                 count_tokens: bool = False) -> BackendRun:
    """``backend`` through lm-eval; ``count_tokens``: the reference's requests also carry their token counts
    (the tokenizer is every backend's, so once is enough)."""
    import lm_eval

    log(f"[{backend.name}] loading {settings.model} ({settings.dtype}, {settings.device})")
    start = time.perf_counter()
    try:
        lm = backend.build(settings)
    except (BackendUnavailable, ValueError) as e:  # e.g. an architecture hf-scatter does not patch
        raise ParityError(f"backend {backend.name}: {e}") from e
    loaded = time.perf_counter()
    with _quiet_git_lookup():
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                          log_samples=True, bootstrap_iters=0, batch_size=settings.batch_size)
    seconds = time.perf_counter() - loaded
    counter = (lambda output_type, arguments: scored_tokens(lm, output_type, arguments)) if count_tokens else None
    run = from_lm_eval(backend.name, backend.label, seconds, results, tasks, scored_tokens=counter)
    run.extra = {"load_s": loaded - start, "eval_s": seconds,
                 "patch_report": sorted(set(getattr(lm, "patch_report", {}).values())),
                 "loaded_as": getattr(lm, "loaded_as", None)}
    log(f"[{backend.name}] evaluated in {seconds:.1f} s")
    del lm, results
    _free_memory()
    return run


def run_parity(model: str, tasks: list[str] | None = None, backends: list[str] | None = None,
               dtype: str = "auto", device: str | None = None, limit: int | float | None = None,
               batch_size: int = 8, tokenizer: str | None = None, include_path: list[str] | None = None,
               builtin_tasks: bool = False, tolerance: float = DEFAULT_TOLERANCE,
               ll_tolerance: float | None = None, max_length: int | None = None, quiet: bool = False,
               gpu_memory: str = "16GiB", profile: str | None = None) -> dict:
    """Evaluate ``model`` (a local checkpoint directory) with each backend and compare them.

    Returns the report (``passed``, ``failures``, per-metric and per-request rows); raises
    :class:`ParityError` for bad input, an architecture a backend cannot run included, before any model
    loads.
    """
    log = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    lm_eval_version = _check_lm_eval()
    import torch

    model_dir = Path(model).resolve()
    config = _read_config(model_dir)
    encoder = is_masked_lm(config)
    tokenizer_dir = Path(tokenizer).resolve() if tokenizer else model_dir
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ParityError(f"--dtype {dtype}: choose auto, float32, bfloat16 or float16")
    if not tolerance >= 0 or (ll_tolerance is not None and not ll_tolerance >= 0):
        raise ParityError("tolerances must be non-negative numbers")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ParityError(f"--device {device}: this machine has no CUDA GPU; use --device cpu")
    try:
        chosen = resolve(backends or ["vanilla", "patched"])
    except BackendUnavailable as e:
        raise ParityError(str(e)) from None
    refusals = [f"backend {b.name}: {reason}" for b in chosen if (reason := b.refuses(config))]
    if refusals:
        raise ParityError("; ".join(refusals))
    model_dtype = _model_dtype(dtype, config)
    scoring_dtype = "float64" if model_dtype == "float32" else "float32"
    settings = LoadSettings(model=str(model_dir), tokenizer=str(tokenizer_dir), dtype=dtype, device=device,
                            batch_size=batch_size, max_length=max_length, encoder=encoder, gpu_memory=gpu_memory,
                            profile=profile, scoring_dtype=scoring_dtype)
    with offline(), _quiet_bundled_task_hints():
        _check_tokenizer(tokenizer_dir, encoder)
        leaves, manager, skipped = resolve_tasks(tasks or [SUITE], include_path or [], builtin_tasks, encoder)
        runs = [_run_backend(b, settings, leaves, manager, limit, log, count_tokens=i == 0)
                for i, b in enumerate(chosen)]
    from hf_scatter.common.timing import run_header

    report = {**run_header(), "dtype": model_dtype, "scoring_dtype": scoring_dtype, "lm_eval": lm_eval_version,
              "model": str(model_dir),
              "model_type": config.get("model_type"), "scoring": "pseudo-log-likelihood (masked LM)" if encoder
              else "causal log-likelihood", "tokenizer": str(tokenizer_dir), "device_arg": device,
              "batch_size": batch_size, "limit": limit, "tasks": leaves, "skipped_tasks": skipped,
              "backends": [{"name": r.name, "label": r.label, **r.extra} for r in runs]}
    roundoff = torch.finfo(getattr(torch, scoring_dtype)).eps / 2
    report.update(compare(runs, tolerance, ll_tolerance, roundoff))
    return report
