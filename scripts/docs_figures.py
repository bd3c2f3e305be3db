"""Keeps every performance figure in README.md and docs/*.md tied to the JSON in docs/results/ it came from.

Three forms, all invisible in rendered Markdown:

- A generated block, for result tables: the lines between
  ``<!-- generated: hf_scatter.bench.moe:to_markdown moe-h100.json -->`` and ``<!-- /generated -->`` are
  exactly what that function returns for that results file. ``python scripts/docs_figures.py --update``
  rewrites every block from its JSON.
- README's results table, ``<!-- generated: docs_figures:headlines index.json -->``: each row of
  ``docs/results/index.json`` names its figures as the expressions below, over any results file, and a sentence
  they are formatted into.
- A table of figures, ``<!-- generated: docs_figures:table tables/moe.json#host-time -->``: the table named
  ``host-time`` in the page's sidecar ``docs/tables/moe.json``, each row a line of text or a ``{"text",
  "figures"}`` pair formatted as README's rows are, so a table row stays one readable line in the page.
- An inline figure: ``1.43x<!--fig train-h100.json: v("results/mixtral-hf-scatter/tokens_per_s") /
  v("results/mixtral-grouped_mm/tokens_per_s")-->``. The expression is Python arithmetic over ``v(path)``
  (a "/"-separated key path into the JSON, or several arguments for keys that contain "/"), ``at(FILE, path)``
  (the same in another results file, for a before/after figure), ``min``, ``max``, ``abs``, ``sum``, ``len``
  and ``round``; its value must round to the number written right before
  the comment, at the precision written (units and ``**`` around the number are ignored; "1,722" is 1722).

A number that is not a measurement but looks like one (a target, a tolerance, a budget) is marked
``<!--given-->`` instead.

``python scripts/docs_figures.py`` checks everything and lists every figure that disagrees with its JSON,
every generated block that is stale, and every measurement-looking figure (a number followed by x, ms, us,
tok/s, req/s, GB/s, TB/s, TFLOP/s or GFLOP/s, or a percentage) that carries no source. ``tests/tools/test_docs.py``
runs the same checks, so a stale figure fails ``make test``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md"))

FIGURE = re.compile(r"<!--fig\s+(?P<file>[^:\s]+):\s*(?P<expr>.*?)\s*-->", re.S)
GENERATED = re.compile(r"<!-- generated: (?P<fn>[\w.]+:\w+) (?P<file>\S+) -->\n(?P<body>.*?)<!-- /generated -->",
                       re.S)
# The number a figure comment refers to: the last one before it, with at most a unit and emphasis in between.
NUMBER_BEFORE = re.compile(r"(?P<number>[-+]?\d[\d,]*(?:\.\d+)?)\s*(?P<unit>[A-Za-zµ%/]*(?:/[A-Za-z]+)?)[*_)\s]*$")
# Measurement-looking figures: these need a source. Sizes (GiB, GB) and shapes are usually inputs, not results,
# except in tables, where every number with a decimal point counts as a result.
MEASURED = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(x|k tok/s| ?ms| ?us| ?µs| ?tok/s| ?req/s| ?GB/s| ?TB/s| ?TFLOP/s"
                      r"| ?GFLOP/s|%)(?![\w/])")
TABLE_DECIMAL = re.compile(r"(?<![\w.])\d[\d,]*\.\d+(?![\w.])")


@dataclass
class Problem:
    doc: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.message}"


@lru_cache(maxsize=None)
def load_results(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def lookup(report: dict, *path: str):
    keys = path[0].split("/") if len(path) == 1 else path
    value = report
    for key in keys:
        if isinstance(value, list):
            key = int(key)
        value = value[key]
    return value


def evaluate(file: str, expr: str) -> float:
    report = load_results(file)
    # at(FILE, PATH): a value of another result file, for a figure that compares two runs
    names = {"v": lambda *path: lookup(report, *path), "at": lambda other, *path: lookup(load_results(other), *path),
             "min": min, "max": max, "abs": abs, "sum": sum, "len": len, "round": round}
    return float(eval(compile(expr, f"<figure in {file}>", "eval"), {"__builtins__": {}}, names))


def written_value(text: str) -> tuple[float, int] | None:
    """(value, decimals) of the number ending ``text``, or None."""
    match = NUMBER_BEFORE.search(text[-60:])
    if match is None:
        return None
    number = match.group("number").replace(",", "")
    decimals = len(number.split(".")[1]) if "." in number else 0
    return float(number), decimals


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _masked(text: str) -> str:
    """``text`` with code blocks, inline code, comments and generated blocks blanked (offsets kept), where
    figures need no inline source."""
    def blank(match: re.Match) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    for pattern in (r"```.*?```", r"`[^`\n]*`", r"<!--.*?-->"):
        text = re.sub(pattern, blank, text, flags=re.S)
    return text


def load_source(ref: str):
    """A generated block's data: one table of a page's sidecar (``tables/PAGE.json#NAME``, under docs/), else a
    results file (under docs/results)."""
    if ref.startswith("tables/"):
        path, _, name = ref.partition("#")
        with open(os.path.join(ROOT, "docs", path)) as f:
            return json.load(f)[name]
    return load_results(ref)


def render(fn: str, file: str) -> str:
    module, name = fn.split(":")
    # this script's own generators (README's table) come from this module, run as a script or imported
    source = sys.modules[__name__] if module == "docs_figures" else importlib.import_module(module)
    return getattr(source, name)(load_source(file)).rstrip("\n") + "\n"


def _formatted(template: str, figures: dict) -> str:
    """``template`` with each named figure evaluated over its results file (as inline figures are)."""
    return template.format(**{name: evaluate(file, expr) for name, (file, expr) in figures.items()})


def table(spec: dict) -> str:
    """A sidecar table: its rows in order, a plain line as written, a ``{"text", "figures"}`` row formatted."""
    return "\n".join(row if isinstance(row, str) else _formatted(row["text"], row["figures"])
                     for row in spec["rows"]) + "\n"


def headlines(index: dict) -> str:
    """README's results table from ``docs/results/index.json``: per headline, its figures evaluated over their JSON
    (as inline figures are) and formatted into its sentence, with the GPU, which direction is better and the
    command; the files are reference links below the table, so no row runs past 200 characters."""
    lines = ["| what | result | better | GPU | command |", "|---|---|---|---|---|"]
    references = []
    for r, row in enumerate(index["headlines"], 1):
        labels = [f"{r}{chr(ord('a') + i)}" for i in range(len(row["files"]))]
        references += [f"[{label}]: docs/results/{file}" for label, file in zip(labels, row["files"])]
        links = f"[json][{labels[0]}]" if len(labels) == 1 else " ".join(f"[{label}]" for label in labels)
        result = _formatted(row["result"], row["figures"])
        lines.append(f"| {row['what']} | {result} | {row['better']} | {row['gpu']} | `{row['command']}` {links} |")
    return "\n".join(lines + [""] + references) + "\n"


def check_doc(doc: str) -> list[Problem]:
    path = os.path.join(ROOT, doc)
    with open(path) as f:
        text = f.read()
    problems = []
    for match in GENERATED.finditer(text):
        line = _line_of(text, match.start())
        try:
            want = render(match.group("fn"), match.group("file"))
        except Exception as e:  # a missing file or function is a problem to report, not a crash
            problems.append(Problem(doc, line, f"generated block {match.group('fn')} {match.group('file')}: "
                                               f"{type(e).__name__}: {e}"))
            continue
        if match.group("body") != want:
            problems.append(Problem(doc, line, f"generated block from {match.group('file')} is stale: run "
                                               f"`python scripts/docs_figures.py --update`"))
    for match in FIGURE.finditer(text):
        line = _line_of(text, match.start())
        written = written_value(text[:match.start()])
        if written is None:
            problems.append(Problem(doc, line, "a figure comment with no number right before it"))
            continue
        try:
            value = evaluate(match.group("file"), match.group("expr"))
        except Exception as e:
            problems.append(Problem(doc, line, f"{match.group('expr')!r} in {match.group('file')}: "
                                               f"{type(e).__name__}: {e}"))
            continue
        shown, decimals = written
        if not math.isclose(value, shown, rel_tol=1e-9, abs_tol=0.5 * 10 ** -decimals + 1e-12):
            problems.append(Problem(doc, line, f"the doc says {shown:g} but {match.group('file')} gives "
                                               f"{value:.{decimals + 2}f} ({match.group('expr')})"))
    bare = _masked(GENERATED.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text))
    unsourced = list(MEASURED.finditer(bare))
    offset = 0
    for line in bare.splitlines(keepends=True):
        if line.lstrip().startswith("|"):
            unsourced += [m for m in TABLE_DECIMAL.finditer(bare, offset, offset + len(line))]
        offset += len(line)
    seen = set()
    for match in sorted(unsourced, key=lambda m: m.start()):
        if match.start() in seen:
            continue
        seen.add(match.start())
        after = text[match.end():match.end() + 24]
        if not re.match(r"[A-Za-zµ%/ ]{0,10}[*_)\s]*<!--(fig|given)\b", after):
            problems.append(Problem(doc, _line_of(text, match.start()),
                                    f"{match.group(0).strip()!r} has no source: add <!--fig FILE: EXPR--> after it"))
    return problems


def check(docs: list[str] = DOCS) -> list[Problem]:
    return [p for doc in docs for p in check_doc(doc)]


def update(docs: list[str] = DOCS) -> int:
    """Rewrite every generated block from its JSON; returns how many changed."""
    changed = 0
    for doc in docs:
        path = os.path.join(ROOT, doc)
        with open(path) as f:
            text = f.read()
        new = GENERATED.sub(lambda m: f"<!-- generated: {m.group('fn')} {m.group('file')} -->\n"
                                      f"{render(m.group('fn'), m.group('file'))}<!-- /generated -->", text)
        if new != text:
            changed += 1
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(new)
            os.replace(tmp, path)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite the generated blocks first")
    args = parser.parse_args(argv)
    if args.update:
        print(f"updated {update()} file(s)")
    problems = check()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
