# `make demo` and `make test` each set up .venv (idempotently) and then run.
# `make test TORCH=2.15.0` (or test-compat) runs against that torch, in a venv of its own kept
# outside the tree ($(VENVS)/torch-2.15.0): torch releases are large, so each is fetched once.
PYTHON ?= python3
TORCH ?=
VENVS ?= $(HOME)/.cache/tessera/venvs
ifeq ($(TORCH),)
VENV := .venv
# The local CPU build satisfies the pin; an unpinned torch would pull the newest CUDA wheels.
TORCH_SPEC := torch==2.13.0
else
VENV := $(VENVS)/torch-$(TORCH)
TORCH_SPEC := torch==$(TORCH)
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-install

.PHONY: install demo test test-fast test-compat lint docs bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: tessera's own install must then leave it as it is.
	$(PY) -m pip install -q "$(TORCH_SPEC)" || $(PY) -m pip install -q "torch>=2.11"
	$(PY) -m pip install -q -e ".[dev,hf,debug,remote,diffusers]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tessera demo

# The Redis tests start a real redis-server (on a loopback port): install it when missing.
test: $(STAMP)
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
	$(PY) -m pytest -q

# The edit loop: no Inductor, no multi-process or Hugging Face tests (under 3 minutes on 2 cores).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not inductor and not slow"

# The private-API surface (tessera/_compat.py) alone: quick, for every supported torch.
test-compat: $(STAMP)
	$(PY) -m pytest -q tests/test_compat.py

lint: $(STAMP)
	$(VENV)/bin/ruff check tessera tests benchmarks examples
	$(VENV)/bin/ruff format --check tessera tests benchmarks examples
	$(VENV)/bin/mypy

# The developers' documentation (docs/), warnings as errors.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict -q

bench: $(STAMP)
	$(PY) -m benchmarks.steady_state

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
