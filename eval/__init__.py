"""lm-eval parity harness (``hf-scatter eval``; docs/eval.md). Installed as ``hf_scatter.eval``.

Runs lm-eval once per backend (vanilla transformers, hf-scatter patched, offloaded, ...) on the same
checkpoint and tokenizer, and compares aggregated metrics and every request's log-likelihood. Also
registers the ``hf-scatter`` (``hf-scatter-mlm``, ``hf-scatter-offloaded``) models with lm-eval, lazily:
importing this package imports neither torch nor the model classes.
"""

from __future__ import annotations

LM_EVAL_MODELS = {
    "hf-scatter": "hf_scatter.eval.lm_model:HFScatterLM",
    "hf-scatter-mlm": "hf_scatter.eval.masked_lm:MaskedLMScorer",
    "hf-scatter-offloaded": "hf_scatter.eval.offloaded_lm:OffloadedLM",
}
MIN_LM_EVAL = "0.4.10"  # the lazy model registry and TaskManager(include_defaults=...)

_PUBLIC = {"run_parity": "runner", "ParityError": "runner", "BACKENDS": "backends", "Backend": "backends",
           "register_backend": "backends", "TASKS_DIR": "suite", "SUITE": "suite", "TASKS": "suite"}


def register_with_lm_eval() -> bool:
    """Make ``--model hf-scatter`` (``-mlm``, ``-offloaded``) resolve in lm-eval's registry; False without lm-eval.

    lm-eval releases with entry-point discovery find them through this package's ``lm_eval.models``
    entry points instead; both name the same classes, so they agree.
    """
    try:
        import lm_eval.models  # noqa: F401  (built-in names first: lm-eval fills an empty registry lazily)
        from lm_eval.api.registry import model_registry
    except ImportError:
        return False
    for name, target in LM_EVAL_MODELS.items():
        if name not in model_registry:
            model_registry.register(name, target=target)
    return True


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register_with_lm_eval()

__all__ = ["LM_EVAL_MODELS", "MIN_LM_EVAL", "register_with_lm_eval", *sorted(_PUBLIC)]
