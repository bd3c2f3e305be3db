"""pytest plugin for ``make test-transformers``: transformers' own model tests, with or without hf-scatter.

Loaded in both runs (``-p hf_scatter_transformers_plugin``, with scripts/ on ``PYTHONPATH``) so they differ
only in ``--hf-scatter-patch``, which calls ``hf_scatter.patch_transformers()`` at configure time: before any
test module is imported, so every model the tests build (constructor, ``from_config``, ``from_pretrained``)
comes out patched. Lives outside tests/ so ``make test`` never collects it.
"""

from __future__ import annotations

import os

import pytest
import torch

# As tests/conftest.py: without a GPU the kernels run under Triton's interpreter, which has to be chosen
# before Triton is imported; per-shape autotuning would dominate a run over hundreds of shapes.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_SCATTER_AUTOTUNE", "0")

# Tests that train for hundreds of steps (TrainingTesterMixin.test_training_overfit: 300 optimizer steps).
LONG_TESTS = ("test_training_overfit",)


def pytest_addoption(parser):
    group = parser.getgroup("hf-scatter")
    group.addoption("--hf-scatter-patch", action="store_true",
                    help="run with hf_scatter.patch_transformers() active (default: vanilla transformers)")
    group.addoption("--hf-scatter-long-timeout", type=int, default=3600,
                    help=f"timeout in seconds for {', '.join(LONG_TESTS)} (default 3600)")


def pytest_configure(config):
    if config.getoption("--hf-scatter-patch"):
        import hf_scatter

        hf_scatter.patch_transformers()


def pytest_report_header(config):
    if config.getoption("--hf-scatter-patch"):
        return "hf-scatter: patch_transformers() active"
    return "hf-scatter: not patched (reference run)"


def pytest_collection_modifyitems(config, items):
    long_timeout = config.getoption("--hf-scatter-long-timeout")
    for item in items:
        if getattr(item, "originalname", item.name).startswith(LONG_TESTS):
            item.add_marker(pytest.mark.timeout(long_timeout))
