# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
STAMP := $(VENV)/.hf-scatter-installed

.PHONY: demo test install clean lock test-latest

# Python writes the venv's compiled files as it first imports each module, also where the image sets
# PYTHONDONTWRITEBYTECODE: otherwise every process of the suite compiles torch and transformers again (an import
# of a transformers MoE model: 8 s -> 20 s), and compiling all 18,000 files up front took a minute of set-up.
PY_RUN := env -u PYTHONDONTWRITEBYTECODE

demo: $(STAMP)
	$(PY_RUN) $(VENV)/bin/hf-scatter demo

# Three workers on the CI kind's 2 cores: a third of the suite's time is in processes its tests start (ranks, CLI
# runs, the wheel's venv), whose imports, rendezvous and waits leave a core idle now and then, and the third worker
# fills it (clean runs on a 2-core machine, 2026-11: 11:54 and 12:02 with two workers, 10:33 and 10:52 with three,
# 11:36 with four). A test file stays in one worker (its fixtures and temp files).
test: $(STAMP)
	$(PY_RUN) $(VENV)/bin/python -m pytest -n 3 --dist loadfile $(PYTEST_ARGS)

# transformers' own Mixtral, DBRX and BERT test suites, unpatched then patched; fails if a test that passes
# unpatched does not pass patched. Slow, so not part of `test` (docs/development.md). Sources: TRANSFORMERS_SRC,
# else a sparse clone at the installed release's tag into .transformers-src/. Extra pytest arguments:
# make test-transformers TRANSFORMERS_TESTS_ARGS="--suites bert -- -k embeds"
.PHONY: test-transformers
test-transformers: $(STAMP)
	$(VENV)/bin/python scripts/transformers_tests.py $(TRANSFORMERS_TESTS_ARGS)

install: $(STAMP)

# Re-runs only when the dependencies, their pinned versions or the set-up script change.
$(STAMP): pyproject.toml .ci/constraints.txt scripts/setup-env.sh
	./scripts/setup-env.sh $(VENV)
	@touch $@

# The suite against the newest release of every dependency but torch (the CPU build this machine provides; PyPI's
# newer torch wheels are CUDA builds), in a fresh venv of its own (.venv-latest), the pins left alone: run by hand
# before a release and now and then (docs/development.md).
test-latest:
	rm -rf .venv-latest
	HF_SCATTER_UNPINNED=1 $(MAKE) test VENV=.venv-latest

# Refresh .ci/constraints.txt to the newest releases, written only once the whole suite has passed with them.
lock: test-latest
	./scripts/write-lock.sh .venv-latest .ci/constraints.txt

clean:
	rm -rf $(VENV) .venv-latest build dist *.egg-info .pytest_cache
