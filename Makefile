# `make demo` and `make test` each set up .venv (idempotently) and then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-install

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: the local CPU build satisfies it; unpinned would pull CUDA wheels.
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.11,<2.14"
	$(PY) -m pip install -q -e ".[dev,hf,debug,remote]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tessera demo

# The Redis tests start a real redis-server (on a loopback port): install it when missing.
test: $(STAMP)
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check tessera tests benchmarks examples
	$(VENV)/bin/ruff format --check tessera tests benchmarks examples
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/steady_state.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
