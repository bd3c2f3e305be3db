"""``make test-transformers``: transformers' own Mixtral, DBRX and BERT test suites, unpatched and patched.

Each suite runs twice in its own pytest process: vanilla transformers, then with
``hf_scatter.patch_transformers()`` active (scripts/hf_scatter_transformers_plugin.py). The run fails when a test
that passes unpatched does not pass patched; the pass counts of both runs are printed per suite.

Test sources: ``$TRANSFORMERS_SRC`` (a transformers checkout at the installed release), else a sparse,
shallow clone of https://github.com/huggingface/transformers at tag ``v<installed version>`` into
``.transformers-src/v<version>`` (git-ignored; cloned once). Nothing of it is committed here.

    python scripts/transformers_tests.py [--suites mixtral dbrx bert] [--out DIR] [-- extra pytest args]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent
PLUGIN = "hf_scatter_transformers_plugin"
REPO_URL = "https://github.com/huggingface/transformers"
SUITES = ("mixtral", "dbrx", "bert")
# What the suites read beyond the model folders: the common mixins (tests/*.py come with any folder in cone
# mode), the generation and export mixins, config and tokenizer fixtures, and src/transformers
# (test_pipeline_mixin imports the checkout's package by path).
SPARSE_DIRS = ["tests/generation", "tests/exporters", "tests/utils", "tests/fixtures", "utils/test_module",
               "src/transformers"]
# transformers' test extras the suites need (import name -> PyPI name): pytest-xdist for a hook its conftest
# registers, httpx for its config tests.
TEST_DEPS = {"parameterized": "parameterized", "xdist": "pytest-xdist", "httpx": "httpx"}


def installed_transformers_version() -> str:
    import transformers

    return transformers.__version__


def _git(*args: str, cwd: Path | None = None) -> None:
    print("+ git", " ".join(args), flush=True)
    subprocess.run(["git", *args], cwd=cwd, check=True)


def transformers_source(version: str, suites) -> Path:
    """The checkout whose tests/ run: $TRANSFORMERS_SRC, else the cached sparse clone at v<version>."""
    env = os.environ.get("TRANSFORMERS_SRC")
    src = Path(env).expanduser().resolve() if env else ROOT / ".transformers-src" / f"v{version}"
    missing = [s for s in suites if not (src / "tests" / "models" / s).is_dir()]
    if not missing and (src / "tests" / "test_modeling_common.py").is_file():
        return src
    if env:
        raise SystemExit(f"TRANSFORMERS_SRC={env} has no tests/test_modeling_common.py or tests/models/"
                         f"{{{','.join(missing)}}}: point it at a transformers checkout (v{version})")
    if src.exists():
        raise SystemExit(f"{src} exists but lacks tests for {', '.join(missing) or 'the common mixins'}: "
                         "remove it to clone afresh, or set TRANSFORMERS_SRC")
    src.parent.mkdir(parents=True, exist_ok=True)
    try:
        _git("clone", "--depth", "1", "--filter=blob:none", "--sparse", "--branch", f"v{version}", REPO_URL, str(src))
        _git("sparse-checkout", "set", *[f"tests/models/{s}" for s in SUITES], *SPARSE_DIRS, cwd=src)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"cloning {REPO_URL} at v{version} failed ({e}); without network, set TRANSFORMERS_SRC "
                         "to a transformers checkout of that tag") from None
    return src


def ensure_test_deps() -> None:
    missing = [pkg for mod, pkg in TEST_DEPS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        print(f"installing transformers' test dependencies: {' '.join(missing)}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", *missing],
                       check=True)


def outcomes(junit: Path) -> dict[str, str]:
    """Test id -> passed / failed / error / skipped, from a pytest junit XML report."""
    result = {}
    for case in ET.parse(junit).iter("testcase"):
        tags = {child.tag for child in case}
        outcome = next((o for tag, o in (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
                        if tag in tags), "passed")
        test_id = f"{case.get('classname')}::{case.get('name')}"
        if result.get(test_id, "passed") == "passed":  # a teardown error after a pass counts
            result[test_id] = outcome
    return result


def run_suite(src: Path, suite: str, patched: bool, out: Path, pytest_args: list[str]) -> tuple[dict | None, float]:
    mode = "patched" if patched else "unpatched"
    junit, log = out / f"{mode}-{suite}.xml", out / f"{mode}-{suite}.log"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", f"tests/models/{suite}", "-p", "no:cacheprovider", "-p", PLUGIN,
           "-o", "log_cli=false", "-q", f"--junitxml={junit}", *(["--hf-scatter-patch"] if patched else []),
           *pytest_args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")]))}
    print(f"{mode:>9} {suite:<8} running (log: {log})", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=src, env=env, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if not junit.exists():  # the process died (crash, kill) before writing its report
        print(f"{mode:>9} {suite:<8} no report: pytest exited with {proc.returncode}; see {log}", flush=True)
        return None, seconds
    return outcomes(junit), seconds


def counts(result: dict[str, str]) -> str:
    n = {o: sum(1 for v in result.values() if v == o) for o in ("passed", "failed", "error", "skipped")}
    return f"{n['passed']} passed, {n['failed']} failed, {n['error']} errors, {n['skipped']} skipped"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    parser.add_argument("--out", type=Path, default=ROOT / ".transformers-src" / "results",
                        help="junit reports and logs (default .transformers-src/results)")
    parser.add_argument("--timeout", type=int, default=900, help="per-test timeout in seconds (default 900)")
    args = parser.parse_args(argv)

    version = installed_transformers_version()
    src = transformers_source(version, args.suites)
    ensure_test_deps()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"transformers {version}, tests from {src}", flush=True)
    pytest_args = [f"--timeout={args.timeout}", *pytest_args]

    regressions, broken, summary = [], [], []
    start = time.perf_counter()
    for suite in args.suites:
        (vanilla, t_vanilla), (ours, t_ours) = (run_suite(src, suite, p, args.out, pytest_args) for p in (False, True))
        if vanilla is None or ours is None:
            broken.append(suite)
            continue
        lost = sorted(t for t, o in vanilla.items() if o == "passed" and ours.get(t) != "passed")
        regressions += [(t, ours.get(t, "not run")) for t in lost]
        summary.append(f"{suite:<8} unpatched: {counts(vanilla)} ({t_vanilla / 60:.1f} min)\n"
                       f"{'':<8} patched:   {counts(ours)} ({t_ours / 60:.1f} min)")
    print("\n" + "\n".join(summary) + f"\n(all runs: {(time.perf_counter() - start) / 60:.1f} min)")
    for test_id, outcome in regressions:
        print(f"REGRESSION {test_id}: passes unpatched, {outcome} patched")
    if broken:
        print(f"no report for {', '.join(broken)}: see the logs in {args.out}")
    if regressions or broken:
        return 1
    print("every test that passes unpatched passes patched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
