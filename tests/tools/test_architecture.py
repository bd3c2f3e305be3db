"""The layer rule of docs/index.md, checked on the imports themselves: nothing imports a layer above its own,
no modules import each other in a circle, no module takes a private name from another, and the tools on top
(conversion, eval) use only hf-scatter's public API.

import-linter would check the first two, but it finds modules by walking the package directory, and two of
hf-scatter's packages (conversion/, eval/) live outside it and are mapped in by pyproject.toml; reading the
imports with ``ast`` sees the installed layout exactly, in a few lines.
"""

import ast
import os
from functools import lru_cache

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where each package's files are, as installed (pyproject.toml's package-dir).
PACKAGE_DIRS = {"hf_scatter": "hf_scatter", "hf_scatter.conversion": "conversion", "hf_scatter.eval": "eval"}

# Bottom to top. A module may import its own layer's modules (without circles) and any layer below; the
# longest matching prefix decides a module's layer.
LAYERS = [
    ["hf_scatter.common", "hf_scatter.tiny"],
    ["hf_scatter.kernels"],
    ["hf_scatter.moe", "hf_scatter.turbo", "hf_scatter.env"],
    ["hf_scatter.models"],
    ["hf_scatter.offload.families"],
    ["hf_scatter.offload.plan"],
    ["hf_scatter.offload.runtime"],
    ["hf_scatter.offload"],
    ["hf_scatter.patching", "hf_scatter"],
    ["hf_scatter.bench", "hf_scatter.demo", "hf_scatter.conversion", "hf_scatter.eval"],
    ["hf_scatter.cli"],
]
PUBLIC_ONLY = ("hf_scatter.conversion", "hf_scatter.eval")  # hf-scatter's own users: its public API only


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)
    for package, folder in sorted(PACKAGE_DIRS.items(), key=lambda kv: -len(kv[1])):
        if rel == folder or rel.startswith(folder + os.sep):
            parts = [package, *os.path.relpath(rel, folder).split(os.sep)]
            parts[-1] = parts[-1].removesuffix(".py")
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(p for p in parts if p != ".")
    raise ValueError(path)


@lru_cache(maxsize=None)
def modules() -> dict[str, str]:
    """Module name -> file, for every module of the installed packages."""
    found = {}
    for folder in PACKAGE_DIRS.values():
        for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(base, f)
                    found[_module_name(path)] = path
    return found


def _is_package(name: str) -> bool:
    return modules()[name].endswith("__init__.py")


@lru_cache(maxsize=None)
def imports(name: str) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every hf-scatter import in ``name``, wherever it
    stands (imports inside functions count: they run too)."""
    tree = ast.parse(open(modules()[name]).read())
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "hf_scatter"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "hf_scatter":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules():  # `from package import module`
                    found.append((sub, None, node.lineno))
                else:
                    found.append((target, alias.name, node.lineno))
    return found


def _layer(name: str) -> int:
    best, level = -1, None
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), i
    assert level is not None, f"{name} is in no layer: add it to LAYERS and docs/index.md"
    return level


def test_every_module_has_a_layer():
    for name in modules():
        _layer(name)


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for name in modules():
        for target, _, line in imports(name):
            if target in modules() and _layer(target) > _layer(name):
                upward.append(f"{modules()[name]}:{line}: {name} (layer {_layer(name)}) imports {target} "
                              f"(layer {_layer(target)})")
    assert not upward, "\n".join(upward)


def test_no_import_circles():
    """Tarjan's strongly connected components over module -> module imports (packages' faces excluded: importing
    a package runs its __init__, which is where the package hands its own names out)."""
    graph = {n: sorted({t for t, _, _ in imports(n) if t in modules() and t != n and not _is_package(t)})
             for n in modules()}
    index, low, stack, on_stack, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_no_module_takes_a_private_name_from_another():
    taken = [f"{modules()[name]}:{line}: {name} imports {target}.{what}"
             for name in modules() for target, what, line in imports(name)
             if what and what.startswith("_") and not what.startswith("__") and target != name]
    assert not taken, "\n".join(taken)


def test_no_module_writes_its_globals():
    """Names a module makes at run time go into a table it owns (pickle finds them through the module's
    ``__getattr__``), never into ``globals()``, where nobody reading the module would look for them."""
    writes = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):  # globals()[name] = ...
                target = node.value
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                    "update", "setdefault", "pop", "__setitem__"):  # globals().update(...) and the like
                target = node.func.value
            else:
                continue
            if isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "globals":
                writes.append(f"{path}:{node.lineno}: {name} writes globals()")
    assert not writes, "\n".join(writes)


def test_no_module_swaps_its_own_class():
    """A package is a plain module: none replaces its ``sys.modules`` entry's class (to be callable, say), a
    trick every reader of ``import`` would have to know about."""
    swaps = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if (isinstance(target, ast.Attribute) and target.attr == "__class__"
                            and "modules[" in ast.unparse(target.value)):
                        swaps.append(f"{path}:{node.lineno}: {name} swaps a module's class")
    assert not swaps, "\n".join(swaps)


def _public_names(package: str) -> set[str]:
    import importlib

    return set(getattr(importlib.import_module(package), "__all__", ()))


@pytest.mark.parametrize("user", PUBLIC_ONLY)
def test_conversion_and_eval_use_only_the_public_api(user):
    """Public: the names a module hands out in its ``__all__`` (``hf_scatter``, ``hf_scatter.offload``,
    ``hf_scatter.tiny``, ...); a module without one is internal."""
    private = []
    for name in modules():
        if not (name == user or name.startswith(user + ".")):
            continue
        for target, what, line in imports(name):
            if target == user or target.startswith(user + "."):
                continue
            public = _public_names(target)
            if not (public and (what is None or what in public)):
                private.append(f"{modules()[name]}:{line}: {name} imports {target}"
                               + (f".{what}" if what else "") + " (not in that module's __all__)")
    assert not private, "\n".join(private)


def test_the_suites_run_order_names_files_that_exist():
    """conftest's heaviest-first order is matched by path: a renamed file would silently fall back to the end."""
    from conftest import HEAVIEST_FILES

    missing = [name for name in HEAVIEST_FILES if not os.path.isfile(os.path.join(ROOT, name))]
    assert not missing, f"tests/conftest.py HEAVIEST_FILES names files that do not exist: {missing}"
