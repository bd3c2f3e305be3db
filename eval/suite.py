"""The bundled offline task suite: lm-eval YAMLs and their small data files, shipped inside the package.

lm-eval resolves a YAML's ``data_files`` against the working directory, so the bundled tasks load their
data through :func:`load_data` instead (``custom_dataset`` in each YAML), which resolves file names
against this package. Nothing is downloaded: the rows become an in-memory ``datasets.Dataset``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DATA_DIR = TASKS_DIR / "data"
SUITE = "hfs_all"  # the small tasks: a quick check, and what a trained checkpoint is best judged on
TASKS = ("hfs_arithmetic", "hfs_facts", "hfs_word_order", "hfs_perplexity", "hfs_generation")
# hfs_sums (1,000 generated documents) with perplexity and generation: on a task of N documents one changed
# decision moves accuracy by 1/N, so only large tasks can resolve the paper's 0.006 (docs/eval.md)
LARGE = "hfs_large"


def read_rows(file: str) -> list[dict]:
    """The rows of one bundled JSONL file (a name inside ``tasks/data``)."""
    path = DATA_DIR / file
    if not path.is_file():
        raise FileNotFoundError(f"hf-scatter eval: bundled data file {path} is missing; reinstall hf-scatter "
                                f"(the wheel ships eval/tasks/data/*.jsonl)")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_data(file: str, split: str = "test", **_task_metadata):
    """lm-eval ``custom_dataset`` hook: one split holding the rows of ``file``.

    lm-eval passes the task's metadata as keyword arguments too; they do not change the data.
    """
    import datasets

    return datasets.DatasetDict({split: datasets.Dataset.from_list(read_rows(file))})


def generated_sums(count: int = 1000, seed: int = 1234, split: str = "test", **_task_metadata):
    """lm-eval ``custom_dataset`` hook for ``hfs_sums``: ``count`` two-digit additions, four choices (the sum
    and three near misses), drawn from ``seed``: many documents without shipping a data file."""
    import datasets

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        choices = [a + b] + rng.sample([a + b + d for d in (-11, -10, -2, -1, 1, 2, 10, 11)], 3)
        rng.shuffle(choices)
        rows.append({"question": f"What is {a} plus {b}?", "choices": [f" {c}" for c in choices],
                     "answer": choices.index(a + b)})
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})
