"""Files written atomically (JSON results, plots): a reader, or a run killed half-way, never sees half a file."""

from __future__ import annotations

import contextlib
import json
import os


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, make_parents: bool = False):
    """Yields a temporary path next to ``path``; renamed onto ``path`` when the block succeeds, removed when it
    raises (``path`` is then left as it was)."""
    path = os.fspath(path)
    if make_parents:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: str | os.PathLike, obj, *, make_parents: bool = False, **dump_options) -> str:
    """Write ``obj`` to ``path`` atomically; returns the path. ``dump_options`` go to :func:`json.dump`
    (default ``indent=1``)."""
    with atomic_path(path, make_parents) as tmp, open(tmp, "w") as f:
        json.dump(obj, f, **{"indent": 1, **dump_options})
    return os.fspath(path)


def save_figure(fig, path: str | os.PathLike, dpi: int = 110) -> str:
    """Save the matplotlib ``fig`` to ``path`` atomically, in the format its suffix names (PNG without one), and
    close it; returns the path."""
    suffix = os.path.splitext(os.fspath(path))[1].lstrip(".").lower()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=dpi, format=suffix or "png")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return os.fspath(path)


__all__ = ["atomic_path", "save_figure", "write_json"]
