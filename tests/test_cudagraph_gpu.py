"""CUDA graphs on a real GPU: decode steps equal eager, capture counts, no re-capture, bounded pool,
the defaults (eager first, then captured pieces) and a warm start that traces and compiles nothing."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tessera
from tessera.models import toy_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device"),
]

CAPTURE_SIZES = [1, 2, 4, 8]
STEPS = 50
ROOT = Path(__file__).resolve().parents[1]


def _decode_model():
    return toy_llama.build_decode(
        num_layers=2, hidden_size=128, intermediate_size=256, max_batch=8, max_len=STEPS + 1, device="cuda"
    )


def _run(compiled, batches, seed=0, steps=STEPS):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    outputs = []
    with torch.no_grad():
        for step in range(steps):
            batch = batches[step % len(batches)]
            ids = torch.randint(0, 256, (batch,), device="cuda", generator=generator)
            outputs.append(compiled(ids, torch.full((batch,), step, device="cuda")).clone())
    return outputs


def _assert_equal(got, expected):
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, s=step: f"step {s}: {m}")


# The exact counts below need every call after the first to run compiled pieces: the compile runs
# at the first call (background_compile=False), as a batch job would have it.
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_piecewise_and_full_equal_eager_over_50_decode_steps(backend):
    model = _decode_model()
    capture_batches = [8, 4, 2, 1]
    padded_batches = [8, 3, 5, 7, 6]  # 3, 5, 6, 7 pad up to 4 and 8
    # Full graphs run attention on padded rows as well: compared at capture sizes.
    for mode, batches in (("piecewise", padded_batches), ("full", capture_batches)):
        eager = _run(copy.deepcopy(model), batches)
        compiled = tessera.compile(
            copy.deepcopy(model),
            backend=backend,
            cudagraph_mode=mode,
            cudagraph_capture_sizes=CAPTURE_SIZES,
            background_compile=False,
        )
        _assert_equal(_run(compiled, batches), eager)


def test_capture_count_no_recapture_and_bounded_pool():
    model = _decode_model()
    compiled = tessera.compile(
        model,
        backend="eager",
        cudagraph_mode="piecewise",
        cudagraph_capture_sizes=CAPTURE_SIZES,
        background_compile=False,
    )
    _run(compiled, [8, 4, 2, 1, 8, 4, 2, 1], steps=9)  # every capture size: warm-up, then capture
    compiled_pieces = sum(not p.is_splitting for p in compiled.pieces)
    captured = tessera.counters.snapshot()["cudagraphs_captured"]
    assert captured == compiled_pieces * len(CAPTURE_SIZES)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    with tessera.counters.expect(cudagraphs_captured=0):
        _run(compiled, [8, 3, 1, 6, 2, 5], seed=1)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - reserved <= 64 * 1024 * 1024


@pytest.mark.inductor
def test_defaults_serve_eager_first_then_capture_the_compiled_pieces(monkeypatch):
    """On the defaults (Inductor, background compile, eager first) with CUDA graphs on: the first
    calls are eager's, later ones replay graphs of the compiled pieces, every output equal."""
    monkeypatch.delenv("TESSERA_BACKGROUND_COMPILE")  # the suite's choice (conftest.py), not a default
    model = _decode_model()
    eager = _run(copy.deepcopy(model), [8, 3, 5, 1])
    compiled = tessera.compile(
        copy.deepcopy(model), cudagraph_mode="piecewise", cudagraph_capture_sizes=CAPTURE_SIZES
    )
    got = _run(compiled, [8, 3, 5, 1], steps=4)
    assert compiled.wait_ready(600)
    got += _run(compiled, [8, 3, 5, 1], steps=STEPS)[4:]
    _assert_equal(got, eager)
    compiled_pieces = sum(not p.is_splitting for p in compiled.pieces)
    assert compiled_pieces > 0
    # 8, 4 (3 pads to it), 8 (5 pads to it) and 1: three capture sizes in use, each captured once.
    assert tessera.counters.snapshot()["cudagraphs_captured"] == compiled_pieces * 3


WARM_SCRIPT = """
import json, sys, torch, tessera
from tessera.models import toy_llama
model = toy_llama.build_decode(num_layers=2, hidden_size=128, intermediate_size=256, max_batch=8,
                               max_len=8, device="cuda")
eager = toy_llama.build_decode(num_layers=2, hidden_size=128, intermediate_size=256, max_batch=8,
                               max_len=8, device="cuda")
compiled = tessera.compile(model, cudagraph_mode="piecewise", cudagraph_capture_sizes=[2, 4])
with torch.no_grad():
    outs = []
    for step, batch in enumerate([4, 3, 4, 2, 4, 3, 1]):
        ids = torch.arange(batch, device="cuda") + step
        pos = torch.full((batch,), step, device="cuda")
        if step == 1:
            compiled.wait_ready(600)
        torch.testing.assert_close(compiled(ids, pos), eager(ids, pos), atol=2e-4, rtol=2e-4)
print(json.dumps({"counters": tessera.counters.snapshot(), "warm": compiled.warm_start}))
"""


@pytest.mark.inductor
@pytest.mark.slow
def test_a_warm_process_on_the_gpu_traces_and_compiles_nothing(tmp_path):
    """Two fresh processes on the defaults: the second loads the Triton artifacts, traces and
    compiles nothing, captures its graphs and gives eager's numbers."""
    env = {**os.environ, "TESSERA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    env.pop("TESSERA_BACKGROUND_COMPILE")  # the suite's choice (conftest.py), not a default
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", WARM_SCRIPT],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["counters"]["inductor_compiles"] > 0
    assert warm["warm"] is True
    assert warm["counters"]["graphs_traced"] == 0
    assert warm["counters"]["inductor_compiles"] == 0
    assert warm["counters"]["cudagraphs_captured"] > 0
