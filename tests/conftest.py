"""Test set-up: Triton runs under its CPU interpreter when no GPU is present.

The interpreter must be chosen before any ``@triton.jit`` function is defined, so this happens at
import time of the conftest, before the test modules import hf_scatter's kernels.
"""

import gc
import io
import os
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests cover many shapes: measuring every candidate config for each would dominate a GPU run.
os.environ.setdefault("HF_SCATTER_AUTOTUNE", "0")
if os.environ.get("HF_SCATTER_TEST_OTHER_BLAS"):  # tolerances must hold under another summation order
    from other_blas import install

    install()

HAS_GPU = torch.cuda.is_available()


def pytest_configure(config):
    """Under pytest-xdist each worker takes its share of the cores for torch's thread pool, and so do the
    processes its tests start (through ``OMP_NUM_THREADS``), unless the user set that variable: two workers
    each running a pool as wide as the machine spin against each other at every parallel region (measured on
    2 cores: two test files 163 s with the default pools, 113 s with one thread each)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


# ``make test`` runs ``--dist loadfile``: a worker takes whole files, in collection order. Alphabetical order
# leaves the heavy tools/ files to the end, and on 2 cores one worker then ran about 45 s after the other had
# finished. These files go first, heaviest first (worker-seconds of a clean run on the 2-core CI kind), so the
# many small files fill the tail; a stale order costs time, never a result.
HEAVIEST_FILES = (
    "tests/models/test_models.py", "tests/models/test_distributed.py", "tests/tools/test_examples.py",
    "tests/offload/plan/test_hrm.py", "tests/tools/test_conversion.py", "tests/tools/test_packaging.py",
    "tests/kernels/test_scattermoe.py", "tests/tools/test_bench.py", "tests/tools/test_eval.py",
    "tests/offload/runtime/test_offload_tensor_parallel.py", "tests/tools/test_cli.py",
)


def _heaviest_first(items) -> None:
    rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: order within a file


def pytest_collection_modifyitems(config, items):
    _heaviest_first(items)
    if HAS_GPU:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run on the GPU machine (docs/development.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_GPU else "cpu")


_USERS_KERNELS = os.environ.get("HF_SCATTER_KERNELS")  # a path the user chose for the whole run


@pytest.fixture
def kernel_bodies(monkeypatch):
    """``kernel_bodies(interpreted)``: on the CPU, False runs the kernels' torch reference instead of the Triton
    interpreter, for a test whose subject is not the kernels' arithmetic (the same ops and autograd functions
    run; only their bodies differ); True runs the interpreter (or the path the user chose for the run). On a
    GPU the kernels run either way."""
    def choose(interpreted: bool) -> None:
        if HAS_GPU:
            return
        if not interpreted:
            monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
        elif _USERS_KERNELS is None:
            monkeypatch.delenv("HF_SCATTER_KERNELS", raising=False)
        else:
            monkeypatch.setenv("HF_SCATTER_KERNELS", _USERS_KERNELS)

    return choose


@pytest.fixture(autouse=True)
def _kernel_bodies_marked(request):
    """``@pytest.mark.kernel_bodies("reference" | "interpreted")`` on a test, class or module (``pytestmark``):
    the closest mark chooses, as ``kernel_bodies`` would. The Triton interpreter costs about 2.5 s per tiny
    model's forward and backward on 2 cores, so integration tests take the reference and name the few that
    keep the interpreter in the loop."""
    mark = request.node.get_closest_marker("kernel_bodies")
    if mark is None:
        return
    if mark.args not in (("reference",), ("interpreted",)):
        raise pytest.UsageError(f"{request.node.nodeid}: kernel_bodies takes 'reference' or 'interpreted', "
                                f"not {mark.args}")
    request.getfixturevalue("kernel_bodies")(mark.args[0] == "interpreted")


@pytest.fixture(scope="session")
def tokenizer():
    from hf_scatter.tiny import byte_level_tokenizer

    return byte_level_tokenizer()


@pytest.fixture
def pickled_copy():
    """``torch.save`` then ``torch.load`` of a whole object (a patched model): what comes back."""
    def copy(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)

    return copy


@pytest.fixture
def freed_by_del():
    """Given a one-item list holding the only reference to an object: whether dropping it frees the object by
    reference counting alone (the garbage collector off), as ``del model`` frees a vanilla model."""
    def freed(holder: list) -> bool:
        ref = weakref.ref(holder[0])
        gc.disable()
        try:
            holder.clear()
            return ref() is None
        finally:
            gc.enable()

    return freed
