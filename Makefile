# Tandem developer entry points. `make demo` and `make test` are the whole quickstart.
# `setup` is idempotent: it rebuilds the venv's install only when pyproject.toml changed.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tandem-installed

.PHONY: setup demo test lint format bench clean

setup: $(STAMP)
	@$(BIN)/tandem kernelspec install --sys-prefix >/dev/null
	@echo "setup: $(VENV) ready, kernelspec 'tandem' installed"

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "setup: $(PYTHON) not found (set PYTHON=...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: an unpinned or transitive torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test]'
	@touch $(STAMP)

demo: setup
	$(BIN)/python scripts/demo.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python scripts/bench_latency.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
