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

# The data store tests run a real redis-server (tests/datastore_fixtures.py); the multi-host test
# builds network namespaces with iproute2's `ip` (tests/integration/test_multihost_netns.py, as
# root); the browser tests drive Debian's chromium (tests/integration/test_browser.py). CI runs as
# root on Debian/Ubuntu; elsewhere install them yourself (the tests fail or skip with the command
# to run). Each entry: command:package[,package...]
TEST_DEPS := redis-server:redis-server ip:iproute2 chromium:chromium,chromium-driver

test-deps:
	@for dep in $(TEST_DEPS); do \
		cmd=$${dep%%:*}; pkg=$$(echo $${dep#*:} | tr , ' '); \
		command -v $$cmd >/dev/null 2>&1 && continue; \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$pkg; \
		else \
			echo "test: $$cmd is missing; install it (Debian: apt-get install -y $$pkg)"; \
		fi; \
	done

# The suite runs in TEST_WORKERS processes (pytest-xdist; 0: in pytest's own): half its time is
# waiting (cluster and kernel starts, elections, heartbeats), so two workers fill two cores. A
# worker takes a whole file at a time (--dist loadfile: a module's cluster and its tests' order stay
# in one process), in collection order (integration first, the many short unit files last to even
# out the end; xdist's default reorder by test count left the one-test integration files, the
# longest, for last). A worker that dies ends the run at once with the file it ran named
# (--max-worker-restart 0): a replacement worker gets no file under loadfile and the run would hang
# until CI's timeout (seen twice on a loaded machine).
TEST_WORKERS ?= 2

test: setup test-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0 tests

# The regression guard (under a minute): small-state sync against scripts/baselines/, then the
# trivial cell against a stock ipykernel. Run after every change to the replica core, Raft or state.
bench: setup
	$(BIN)/python scripts/bench_state_sync.py --quick
	$(BIN)/python scripts/bench_latency.py --cells 200

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
