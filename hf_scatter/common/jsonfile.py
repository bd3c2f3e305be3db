"""JSON files written atomically: a reader (or a run killed half-way) never sees half a file."""

from __future__ import annotations

import json
import os


def write_json(path: str | os.PathLike, obj, *, make_parents: bool = False, **dump_options) -> str:
    """Write ``obj`` to ``path`` through a temporary file in the same folder, renamed into place; returns the
    path. ``dump_options`` go to :func:`json.dump` (default ``indent=1``)."""
    path = os.fspath(path)
    if make_parents:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, **{"indent": 1, **dump_options})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


__all__ = ["write_json"]
