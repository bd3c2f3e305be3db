"""What parity means: aggregated metrics within a tolerance, and every request's answer side by side.

Input is lm-eval's own output for each backend (``results`` and ``samples``, logged per request); the
first backend is the reference. Accuracy-like metrics and bits per byte are compared by absolute error
(the ScatterMoE paper's criterion: 0.006); perplexities, which are exponentials of mean log-likelihoods,
by relative error with the same tolerance. Per request: the absolute difference of every log-likelihood,
how many multiple-choice decisions (acc and acc_norm argmax) changed, and how many generations differ.

A request's log-likelihood is a sum over its scored tokens, so its tolerance grows with them
(:func:`ll_allowance`): a per-token tolerance times the tokens, plus the worst-case rounding of that sum
in the dtype it was scored in. An absolute bound per request would fail long documents on one processor
and pass them on another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

RELATIVE_METRICS = {"perplexity", "word_perplexity", "byte_perplexity"}
LOGLIKELIHOOD_TYPES = {"loglikelihood", "multiple_choice", "loglikelihood_rolling"}


@dataclass
class BackendRun:
    """One backend's lm-eval output, reduced to what parity needs."""

    name: str
    label: str
    seconds: float
    metrics: dict[str, dict[str, float]]  # task -> metric -> value
    output_types: dict[str, str]  # task -> lm-eval output type
    # task -> [{doc_id, idx, value, continuation, tokens}]; tokens: how many tokens the log-likelihood sums over
    requests: dict[str, list[dict]] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


def _metric_name(key: str) -> str:
    """lm-eval's "metric,filter" key: the metric alone for the default filter, else both."""
    metric, _, filter_name = key.partition(",")
    return metric if filter_name == "none" else key


def from_lm_eval(name: str, label: str, seconds: float, results: dict, tasks: list[str],
                 scored_tokens: Callable[[str, tuple], int] | None = None) -> BackendRun:
    """Pick metrics (no stderr) and per-request responses for ``tasks`` out of ``simple_evaluate``'s dict;
    ``scored_tokens(output_type, arguments)`` counts the tokens a log-likelihood request sums over."""
    metrics, types, requests = {}, {}, {}
    for task in tasks:
        row = results["results"][task]
        metrics[task] = {_metric_name(key): float(value) for key, value in row.items()
                         if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
        types[task] = results["configs"][task]["output_type"]
        flat = []
        for sample in sorted(results["samples"][task], key=lambda s: int(s["doc_id"])):
            for idx, (args, resp) in enumerate(zip(sample["arguments"], sample["resps"])):
                value = resp[0]  # first repeat
                if isinstance(value, (tuple, list)):  # loglikelihood: (logprob, is_greedy)
                    value = value[0]
                continuation = args[1] if types[task] == "multiple_choice" else None
                tokens = scored_tokens(types[task], tuple(args)) \
                    if scored_tokens is not None and types[task] in LOGLIKELIHOOD_TYPES else None
                flat.append({"doc_id": int(sample["doc_id"]), "idx": idx, "value": value,
                             "continuation": continuation, "tokens": tokens})
        requests[task] = flat
    return BackendRun(name, label, seconds, metrics, types, requests)


def _metric_error(metric: str, ref: float, value: float) -> tuple[float, float, str]:
    abs_err = abs(value - ref)
    rel_err = abs_err / abs(ref) if ref else (0.0 if abs_err == 0 else math.inf)
    return abs_err, rel_err, ("rel" if metric in RELATIVE_METRICS else "abs")


def _choice_scores(requests: list[dict], normalised: bool) -> dict[int, list[float]]:
    """doc -> each choice's score, as lm-eval's acc (log-likelihood) or acc_norm (per character) sees it."""
    scores: dict[int, list[float]] = {}
    for r in requests:
        value = float(r["value"])
        scores.setdefault(r["doc_id"], []).append(value / max(1, len(r["continuation"])) if normalised else value)
    return scores


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: (xs[i], -i))  # ties keep the first, like np.argmax


def _changed_decisions(ref: list[dict], run: list[dict], normalised: bool) -> list[dict]:
    """Docs whose chosen answer differs, with the reference's margin between the two answers: a margin
    smaller than the log-likelihood differences of that doc is a near-tie that rounding can flip."""
    a, b = _choice_scores(ref, normalised), _choice_scores(run, normalised)
    changed = []
    for doc, scores in a.items():
        i, j = _argmax(scores), _argmax(b[doc])
        if i != j:
            changed.append({"doc_id": doc, "reference_choice": i, "choice": j,
                            "reference_margin": scores[i] - scores[j],
                            "max_abs_diff": max(abs(x - y) for x, y in zip(scores, b[doc]))})
    return changed


def ll_allowance(tokens: int, reference: float, per_token: float, roundoff: float) -> float:
    """The largest |difference| two runs' log-likelihoods of one request may show: each of the ``tokens``
    log-probabilities may differ by ``per_token`` (the model's arithmetic), and each run rounds the
    log-probabilities and their running sum ``tokens`` times in the scoring dtype (unit roundoff
    ``roundoff``), each rounding off by at most ``roundoff`` times the partial sum; log-probabilities are
    never positive, so every partial sum is bounded by the total, ``|reference|``."""
    return tokens * (per_token + 2 * roundoff * abs(reference))


def _request_stats(task: str, output_type: str, ref: list[dict], run: list[dict],
                   ll_tolerance: float | None, roundoff: float) -> dict:
    if len(ref) != len(run) or any((a["doc_id"], a["idx"]) != (b["doc_id"], b["idx"]) for a, b in zip(ref, run)):
        raise ValueError(f"{task}: the backends answered different requests ({len(ref)} vs {len(run)}); "
                         f"parity needs the same task data, limit and tokenizer in every run")
    stats = {"requests": len(ref)}
    stats["ok"] = True
    if output_type in LOGLIKELIHOOD_TYPES:
        diffs = [abs(float(b["value"]) - float(a["value"])) for a, b in zip(ref, run)]
        diffs = [d if not math.isnan(d) else math.inf for d in diffs]
        tokens = [max(1, a.get("tokens") or 0) for a in ref]  # no count known: one token
        per_token = [d / n for d, n in zip(diffs, tokens)]
        stats.update(ll_max_abs=max(diffs, default=0.0), ll_mean_abs=sum(diffs) / max(1, len(diffs)),
                     ll_max_per_token=max(per_token, default=0.0), ll_abs_diffs=diffs, ll_tokens=tokens)
        if ll_tolerance is not None:
            stats["ok"] = all(d <= ll_allowance(n, float(a["value"]), ll_tolerance, roundoff)
                              for d, n, a in zip(diffs, tokens, ref))
    if output_type == "multiple_choice":
        for key, normalised in (("decisions_changed", False), ("decisions_norm_changed", True)):
            changed = _changed_decisions(ref, run, normalised)
            stats[key] = len(changed)
            stats[key + "_detail"] = changed
        stats["docs"] = len({r["doc_id"] for r in ref})
    if output_type == "generate_until":
        stats["generations_changed"] = sum(a["value"] != b["value"] for a, b in zip(ref, run))
    return stats


def compare(runs: list[BackendRun], tolerance: float, ll_tolerance: float | None, roundoff: float = 0.0) -> dict:
    """The parity verdict of ``runs[1:]`` against ``runs[0]``; ``passed`` is False past either tolerance.

    ``ll_tolerance`` is per scored token and ``roundoff`` the unit roundoff of the dtype log-likelihoods
    were scored in (:func:`ll_allowance`); the reference run's requests carry the token counts."""
    ref, candidates = runs[0], runs[1:]
    failures, metric_rows, request_rows = [], [], []
    for task, metrics in ref.metrics.items():
        for metric, ref_value in metrics.items():
            row = {"task": task, "metric": metric, "values": {ref.name: ref_value}, "errors": {}, "ok": True}
            for run in candidates:
                value = run.metrics.get(task, {}).get(metric, math.nan)
                abs_err, rel_err, check = _metric_error(metric, ref_value, value)
                row["values"][run.name] = value
                row["errors"][run.name] = {"abs": abs_err, "rel": rel_err}
                row["check"] = check
                err = rel_err if check == "rel" else abs_err
                if not err <= tolerance:  # NaN fails too
                    row["ok"] = False
                    failures.append(f"{task} {metric}: {run.label} {value:.6g} vs {ref.label} {ref_value:.6g}, "
                                    f"{check} error {err:.3g} > {tolerance:g}")
            metric_rows.append(row)
        for run in candidates:
            stats = _request_stats(task, ref.output_types[task], ref.requests[task], run.requests[task],
                                   ll_tolerance, roundoff)
            if not stats["ok"]:
                failures.append(f"{task}: {run.label} per-request log-likelihood difference up to "
                                f"{stats['ll_max_per_token']:.3g} per token (max {stats['ll_max_abs']:.3g}) > "
                                f"{ll_tolerance:g} per token")
            request_rows.append({"task": task, "output_type": ref.output_types[task], "backend": run.name, **stats})
    summary = {}
    for run in candidates:
        rows = [r for r in request_rows if r["backend"] == run.name]
        diffs = [d for r in rows for d in r.get("ll_abs_diffs", [])]
        summary[run.name] = {
            "ll_requests": len(diffs), "ll_max_abs": max(diffs, default=0.0),
            "ll_mean_abs": sum(diffs) / max(1, len(diffs)),
            "ll_max_per_token": max((r["ll_max_per_token"] for r in rows if "ll_max_per_token" in r), default=0.0),
            "docs": sum(r.get("docs", 0) for r in rows),
            "decisions_changed": sum(r.get("decisions_changed", 0) for r in rows),
            "decisions_norm_changed": sum(r.get("decisions_norm_changed", 0) for r in rows),
            "generations": sum(r["requests"] for r in rows if r["output_type"] == "generate_until"),
            "generations_changed": sum(r.get("generations_changed", 0) for r in rows)}
    return {"reference": ref.name, "tolerance": {"metric": tolerance, "loglikelihood": ll_tolerance,
                                                 "loglikelihood_per": "token", "scoring_roundoff": roundoff},
            "metrics": metric_rows, "requests": request_rows, "summary": summary, "failures": failures,
            "passed": not failures}
