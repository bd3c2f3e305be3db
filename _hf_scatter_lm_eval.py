"""Startup hook, run by ``hf_scatter_lm_eval.pth``: lets the stock ``lm_eval --model hf-scatter`` command
find hf-scatter's lm-eval models.

lm-eval (up to 0.4.13 and 0.5.0.dev1) knows only the models registered in the running process and reads
no plugin entry points. This hook waits for ``lm_eval.models`` to be imported (it imports nothing itself,
so every other Python start pays only for adding one finder) and then registers, by name, every model
that installed packages declare under the ``lm_eval.models`` entry-point group, hf-scatter's included;
lm-eval imports a model's module only when that model is asked for.
"""

from __future__ import annotations

import sys

GROUP = "lm_eval.models"
TRIGGER = "lm_eval.models"


def register_entry_points() -> list[str]:
    """Name every declared ``lm_eval.models`` entry point in lm-eval's registry (lazily); returns the new names."""
    from importlib.metadata import entry_points

    from lm_eval.api.registry import model_registry

    added = []
    for point in entry_points(group=GROUP):
        if point.name not in model_registry:
            model_registry.register(point.name, target=point.value)
            added.append(point.name)
    return added


class _AfterImport:
    """A meta-path finder that lets the normal finders load ``lm_eval.models``, then registers."""

    def find_spec(self, name, path=None, target=None):
        if name != TRIGGER:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                register_entry_points()
            except Exception as e:  # never break lm-eval itself
                print(f"hf-scatter: could not register lm-eval model entry points: {e}", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


install()
