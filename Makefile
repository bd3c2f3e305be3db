# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
STAMP := $(VENV)/.hf-scatter-installed

.PHONY: demo test install clean

demo: $(STAMP)
	$(VENV)/bin/hf-scatter demo

# Two workers (the CI machine has 2 cores); a test file stays in one worker (its fixtures and temp files).
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)

# transformers' own Mixtral, DBRX and BERT test suites, unpatched then patched; fails if a test that passes
# unpatched does not pass patched. Slow, so not part of `test` (docs/development.md). Sources: TRANSFORMERS_SRC,
# else a sparse clone at the installed release's tag into .transformers-src/. Extra pytest arguments:
# make test-transformers TRANSFORMERS_TESTS_ARGS="--suites bert -- -k embeds"
.PHONY: test-transformers
test-transformers: $(STAMP)
	$(VENV)/bin/python scripts/transformers_tests.py $(TRANSFORMERS_TESTS_ARGS)

install: $(STAMP)

# Re-runs only when the dependencies or the set-up script change.
$(STAMP): pyproject.toml scripts/setup-env.sh
	./scripts/setup-env.sh $(VENV)
	@touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
