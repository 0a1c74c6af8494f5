# `make demo` and `make test` each set up .venv (idempotently) and then run, on the versions in
# constraints.txt (the tested ones: CI installs exactly these).
# `make test TORCH=2.15.0` (or test-compat) runs against that torch, in a venv of its own kept
# outside the tree ($(VENVS)/torch-2.15.0): torch releases are large, so each is fetched once.
PYTHON ?= python3
TORCH ?=
VENVS ?= $(HOME)/.cache/tessera/venvs
ifeq ($(TORCH),)
VENV := .venv
# The local CPU build satisfies the pin; an unpinned torch would pull the newest CUDA wheels.
TORCH_SPEC := $(shell grep '^torch==' constraints.txt)
else
VENV := $(VENVS)/torch-$(TORCH)
TORCH_SPEC := torch==$(TORCH)
endif
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-install
EXTRAS := .[dev,hf,debug,remote,objectstore,diffusers]
# The newest release of every dependency but torch, and transformers' oldest that pyproject admits.
NEWEST := $(VENVS)/newest-$(subst ==,-,$(TORCH_SPEC))
HF_OLDEST ?= 4.57.1
OLDEST := $(VENVS)/hf-$(HF_OLDEST)-$(subst ==,-,$(TORCH_SPEC))
REDIS := command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null)
# ccache for the suite's kernel builds (tests/conftest.py): without it the suite still runs, slower.
CCACHE := command -v ccache >/dev/null || (apt-get update -qq && apt-get install -y -qq ccache >/dev/null) \
	|| echo "ccache not installed: the suite builds every kernel itself (slower)"

.PHONY: install demo test test-extended test-fast test-compat test-newest pins test-hf-oldest lint docs bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: tessera's own install must then leave it as it is.
	$(PY) -m pip install -q "$(TORCH_SPEC)" || $(PY) -m pip install -q "torch>=2.11"
	# The tested versions of everything else (torch's own line left out: TORCH chooses it).
	grep -v '^torch==' constraints.txt > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e "$(EXTRAS)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tessera demo

# The Redis tests start a real redis-server (on a loopback port): install it when missing.
# One pytest worker per core (most tests wait on child processes, so one process left a core idle:
# CI has a time bound, 45 minutes on 2 cores), the 25 slowest listed at the end.
test: $(STAMP)
	$(REDIS)
	$(CCACHE)
	$(PY) -m pytest -q -m "not extended" -n auto --maxprocesses 4 --dist worksteal --durations=25

# More model families for behaviours `make test` covers (on demand: CI's time is bounded).
test-extended: $(STAMP)
	$(PY) -m pytest -q -m extended

# The edit loop: no Inductor, no multi-process or Hugging Face tests (under 3 minutes on 2 cores).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not inductor and not slow"

# The private-API surface (tessera/_compat/) alone: quick, for every supported torch.
test-compat: $(STAMP)
	$(PY) -m pytest -q tests/test_compat.py

# The suite on the newest release of every dependency (torch aside: TORCH's, default the pinned
# one), as `pip install tessera[...]` gives a user today; its venv is outside the tree, upgraded
# at every run. Green? `make pins` moves constraints.txt to these versions.
test-newest:
	test -x $(NEWEST)/bin/python || $(PYTHON) -m venv $(NEWEST)
	echo "$(TORCH_SPEC)" > $(NEWEST)/torch.txt  # never the newest torch: CUDA wheels of many GB
	$(NEWEST)/bin/python -m pip install -q -c $(NEWEST)/torch.txt -U --upgrade-strategy eager -e "$(EXTRAS)"
	$(REDIS)
	$(NEWEST)/bin/python -m pytest -q

# constraints.txt rewritten from the venv `make test-newest` ran (its comments and torch's pin kept).
pins:
	test -x $(NEWEST)/bin/python || (echo "run make test-newest first" >&2; false)
	grep -E '^(#|torch==)' constraints.txt > constraints.txt.new
	$(NEWEST)/bin/python -m pip freeze --exclude-editable | grep -v -E '^(#|torch==)' >> constraints.txt.new
	mv constraints.txt.new constraints.txt

# The Hugging Face tests on transformers' oldest release that pyproject.toml admits.
test-hf-oldest:
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	echo "$(TORCH_SPEC)" > $(OLDEST)/torch.txt
	$(OLDEST)/bin/python -m pip install -q -c $(OLDEST)/torch.txt -e ".[dev,hf]" "transformers==$(HF_OLDEST)"
	$(OLDEST)/bin/python -m pytest -q tests/test_hf.py

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
