# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
STAMP := $(VENV)/.hf-scatter-installed

.PHONY: demo test install clean

demo: $(STAMP)
	$(VENV)/bin/hf-scatter demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

install: $(STAMP)

# Re-runs only when the dependencies or the set-up script change.
$(STAMP): pyproject.toml scripts/setup-env.sh
	./scripts/setup-env.sh $(VENV)
	@touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
