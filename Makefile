# Tandem developer entry points. `make demo` and `make test` are the whole quickstart.
# `setup` is idempotent: it rebuilds the venv's install only when pyproject.toml changed. It installs
# the Jupyter front ends too (JupyterLab, jupyter-console, papermill, ipywidgets: the [jupyter] extra).

# python3.11 where it runs (a pyenv shim may exist without the version behind it), else python3;
# setup checks that the interpreter is at least 3.11 (pyproject's requires-python).
PYTHON ?= $(shell python3.11 -c '' >/dev/null 2>&1 && echo python3.11 || echo python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-installed

.PHONY: setup demo test test-deps lint format bench clean

setup: $(STAMP)
	@$(BIN)/tandem kernelspec install --sys-prefix >/dev/null
	@echo "setup: $(VENV) ready, kernelspec 'tandem' installed"

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "setup: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
		{ echo "setup: $(PYTHON) is older than 3.11 (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: an unpinned or transitive torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test,jupyter]'
	@touch $(STAMP)

demo: setup
	$(BIN)/python scripts/demo.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The data store tests run a real redis-server (tests/datastore_fixtures.py). CI runs as root on
# Debian/Ubuntu; elsewhere install it yourself (the tests fail with the command to run). The browser
# tests (tests/integration/test_browser.py) drive Debian's chromium; without it they skip.
test-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server; \
		else \
			echo "test: redis-server is missing; install it (Debian: apt-get install -y redis-server)"; \
		fi; \
	}
	@command -v chromium >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium chromium-driver; \
		else \
			echo "test: chromium is missing (the browser tests skip); install it (Debian: apt-get install -y chromium chromium-driver)"; \
		fi; \
	}

test: setup test-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

# The regression guard (under a minute): small-state sync against scripts/baselines/, then the
# trivial cell against a stock ipykernel. Run after every change to the replica core, Raft or state.
bench: setup
	$(BIN)/python scripts/bench_state_sync.py --quick
	$(BIN)/python scripts/bench_latency.py --cells 200

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
