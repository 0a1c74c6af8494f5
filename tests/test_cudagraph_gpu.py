"""CUDA graphs on a real GPU: decode steps equal eager, capture counts, no re-capture, bounded pool."""

from __future__ import annotations

import copy

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


def _decode_model():
    return toy_llama.build_decode(
        num_layers=2, hidden_size=128, intermediate_size=256, max_batch=8, max_len=STEPS + 1, device="cuda"
    )


def _run(compiled, batches, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    outputs = []
    with torch.no_grad():
        for step in range(STEPS):
            batch = batches[step % len(batches)]
            ids = torch.randint(0, 256, (batch,), device="cuda", generator=generator)
            outputs.append(compiled(ids, torch.full((batch,), step, device="cuda")).clone())
    return outputs


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_piecewise_and_full_equal_eager_over_50_decode_steps(backend):
    model = _decode_model()
    capture_batches = [8, 4, 2, 1]
    padded_batches = [8, 3, 5, 7, 6]  # 3, 5, 6, 7 pad up to 4 and 8
    eager = _run(copy.deepcopy(model), padded_batches)
    piecewise = tessera.compile(
        copy.deepcopy(model),
        backend=backend,
        cudagraph_mode="piecewise",
        cudagraph_capture_sizes=CAPTURE_SIZES,
    )
    got = _run(piecewise, padded_batches)
    for step, (a, b) in enumerate(zip(got, eager, strict=True)):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m, s=step: f"step {s}: {m}")

    # Full graphs run attention on padded rows as well: compare at capture sizes.
    eager_full = _run(copy.deepcopy(model), capture_batches)
    full = tessera.compile(
        copy.deepcopy(model), backend=backend, cudagraph_mode="full", cudagraph_capture_sizes=CAPTURE_SIZES
    )
    got_full = _run(full, capture_batches)
    for a, b in zip(got_full, eager_full, strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_capture_count_no_recapture_and_bounded_pool():
    model = _decode_model()
    compiled = tessera.compile(
        model, backend="eager", cudagraph_mode="piecewise", cudagraph_capture_sizes=CAPTURE_SIZES
    )
    _run(compiled, [8, 4, 2, 1, 8, 4, 2, 1])  # every capture size: warm-up, then capture
    compiled_pieces = sum(not p.is_splitting for p in compiled.pieces)
    captured = tessera.counters.snapshot()["cudagraphs_captured"]
    assert captured == compiled_pieces * len(CAPTURE_SIZES)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    with tessera.counters.expect(cudagraphs_captured=0):
        _run(compiled, [8, 3, 1, 6, 2, 5], seed=1)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() - reserved <= 64 * 1024 * 1024
