"""Benchmarks: re-rendering saved results works anywhere; a tiny training-step run works on the GPU."""

import json
from pathlib import Path

import pytest
import torch

from hf_scatter.cli import main

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


@pytest.mark.parametrize("suite,saved", [("moe", "moe-h200.json"), ("train", "train-h200.json")])
def test_bench_replot_renders_table_and_png_from_saved_json(suite, saved, tmp_path, capsys):
    png = tmp_path / "plot.png"
    assert main(["bench", suite, "--replot", str(RESULTS / saved), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    report = json.loads((RESULTS / saved).read_text())
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    for name in report["results"]:  # moe: config names; train: implementation names
        assert any(f"| {name} |" in row for row in rows), name
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.gpu
def test_bench_train_smoke_run_patched_matches_vanilla_first_loss():
    from hf_scatter.bench import train

    report = train.run(train.IMPLS, cfg=train.SMOKE, warmup=1, steps=2)
    res = report["results"]
    assert set(res) == set(train.IMPLS)
    for family in ("mixtral", "dbrx"):
        vanilla = res[train.BASELINES[family]]["first_step_loss"]
        assert abs(res[f"{family}-hf-scatter"]["first_step_loss"] - vanilla) < 2e-2 * vanilla
    assert all(r["tokens_per_s"] > 0 and r["peak_gib"] > 0 and "breakdown_ms" in r for r in res.values())
