"""The parity report as people read it: the Table-1-style metric table, per-request differences, a verdict,
and a plot of every request's log-likelihood difference."""

from __future__ import annotations

from hf_scatter.common.atomic_files import save_figure
from hf_scatter.common.markdown import markdown_table


def _num(x: float) -> str:
    return f"{x:.4f}" if abs(x) < 1e4 else f"{x:.6g}"


def _err(x: float) -> str:
    return "0" if x == 0 else f"{x:.2g}"


def metric_table(report: dict) -> str:
    """The Table-1-style metric table: every aggregated metric of every backend against the reference."""
    labels = {b["name"]: b["label"] for b in report["backends"]}
    ref, cands = report["reference"], [b["name"] for b in report["backends"][1:]]
    header = ["task", "metric", labels[ref]]
    for c in cands:
        suffix = f" ({labels[c]})" if len(cands) > 1 else ""
        header += [labels[c], f"abs error{suffix}", f"rel error{suffix}"]
    header.append(f"within {report['tolerance']['metric']:g}")
    rows = []
    for m in report["metrics"]:
        row = [m["task"], m["metric"] + (" (rel)" if m.get("check") == "rel" else ""), _num(m["values"][ref])]
        for c in cands:
            row += [_num(m["values"][c]), _err(m["errors"][c]["abs"]), _err(m["errors"][c]["rel"])]
        rows.append(row + ["yes" if m["ok"] else "**NO**"])
    return markdown_table(header, rows)


def request_table(report: dict) -> str:
    """Per task and backend: log-likelihood differences, changed decisions and changed generations."""
    labels = {b["name"]: b["label"] for b in report["backends"]}
    ll_tol = report["tolerance"]["loglikelihood"]
    per_token = any("ll_max_per_token" in r for r in report["requests"])  # reports made before: per request
    header = ["task", "requests", "backend", "max abs Δ log-lik", "mean abs Δ log-lik",
              *(["max abs Δ per token"] if per_token else []), "decisions changed (acc / acc_norm)",
              "generations changed",
              "ok" if ll_tol is None else f"Δ <= {ll_tol:g}{' per token' if per_token else ''}"]
    rows = []
    for r in report["requests"]:
        decisions = (f"{r['decisions_changed']} / {r['decisions_norm_changed']} of {r['docs']}"
                     if "docs" in r else "")
        generations = f"{r['generations_changed']} of {r['requests']}" if "generations_changed" in r else ""
        rows.append([r["task"], r["requests"], labels[r["backend"]], _err(r["ll_max_abs"]) if "ll_max_abs" in r else "",
                     _err(r["ll_mean_abs"]) if "ll_mean_abs" in r else "",
                     *([_err(r["ll_max_per_token"]) if "ll_max_per_token" in r else ""] if per_token else []),
                     decisions, generations, "yes" if r["ok"] else "**NO**"])
    return markdown_table(header, rows)


def to_markdown(report: dict) -> str:
    labels = {b["name"]: b["label"] for b in report["backends"]}
    ref, cands = report["reference"], [b["name"] for b in report["backends"][1:]]
    tol = report["tolerance"]
    ll_tol = tol["loglikelihood"]
    out = [f"{report['model']} ({report['model_type']}, {report['dtype']}, {report['device']}); "
           f"{report['scoring']}; lm-eval {report['lm_eval']}, limit {report['limit']}", "",
           metric_table(report), "", request_table(report)]
    out += [f"{b['label']} loaded as: {b['loaded_as']}" for b in report["backends"] if b.get("loaded_as")]

    out.append("")
    for c in cands:
        s = report["summary"][c]
        out.append(f"{labels[c]} vs {labels[ref]}: {s['ll_requests']} log-likelihood requests, max abs difference "
                   f"{_err(s['ll_max_abs'])}, mean {_err(s['ll_mean_abs'])}; multiple-choice decisions changed "
                   f"{s['decisions_changed']} (acc) / {s['decisions_norm_changed']} (acc_norm) of {s['docs']}; "
                   f"generations changed {s['generations_changed']} of {s['generations']}")
    for r in report["requests"]:
        for key, name in (("decisions_changed_detail", "acc"), ("decisions_norm_changed_detail", "acc_norm")):
            for d in r.get(key, []):
                out.append(f"changed decision: {r['task']} doc {d['doc_id']} ({name}, {labels[r['backend']]}): choice "
                           f"{d['reference_choice']} -> {d['choice']}; reference margin {d['reference_margin']:.3g}, "
                           f"largest score difference in the doc {d['max_abs_diff']:.3g}")
    for task, why in report.get("skipped_tasks", {}).items():
        out.append(f"skipped {task}: {why}")
    if report["passed"]:
        out.append(f"PASS: every metric within {tol['metric']:g}"
                   + ("" if ll_tol is None else f", every log-likelihood within {ll_tol:g} per scored token"))
    else:
        out += ["FAIL:"] + [f"- {f}" for f in report["failures"]]
    return "\n".join(out)


def plot(report: dict, path: str) -> None:
    """Per task, every request's |Δ log-likelihood| per scored token against the reference (log scale), one
    colour per backend: the quantity ``--ll-tolerance`` bounds, comparable across short and long requests.
    Reports made before token counts were kept show the per-request differences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {b["name"]: b["label"] for b in report["backends"]}
    rows = [r for r in report["requests"] if r.get("ll_abs_diffs")]
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks)), 4))
    floor = 1e-9  # exact agreement is drawn on the floor
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    per_token = all("ll_tokens" in r for r in rows)
    unit = " per token" if per_token else ""
    for b_i, backend in enumerate(backends):
        for t_i, task in enumerate(tasks):
            row = next((r for r in rows if r["task"] == task and r["backend"] == backend), None)
            diffs = [] if row is None else [d / n for d, n in zip(row["ll_abs_diffs"], row["ll_tokens"])] \
                if per_token else row["ll_abs_diffs"]
            x = [t_i + (b_i - (len(backends) - 1) / 2) * 0.25 + (i % 7 - 3) * 0.02 for i in range(len(diffs))]
            ax.scatter(x, [max(d, floor) for d in diffs], s=8, alpha=0.6, color=f"C{b_i}",
                       label=labels[backend] if t_i == 0 else None)
    ll_tol = report["tolerance"]["loglikelihood"]
    if ll_tol:
        ax.axhline(ll_tol, color="red", linestyle="--", linewidth=1, label=f"tolerance {ll_tol:g}{unit}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(tasks)), tasks, rotation=20)
    ax.set_ylabel(f"|Δ log-likelihood|{unit} vs {labels[report['reference']]} (equal: {floor:g})")
    ax.set_title(f"per-request log-likelihood differences, {report['model_type']} {report['dtype']} "
                 f"({report['device']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
