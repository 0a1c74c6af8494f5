"""End to end with the Inductor compiler (a few tests only: Inductor is slow on 2 cores)."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.models import toy_llama

pytestmark = pytest.mark.inductor


def test_toy_llama_inductor_matches_eager_inside_and_outside_compile_sizes():
    layers = 2
    model = toy_llama.build(num_layers=layers)
    compiled = tessera.compile(model, backend="inductor", compile_sizes=[16], compile_ranges=[8])
    expected_artifacts = ("general", "size 16", "range [1,8]", "range [9,max]")
    with tessera.counters.expect(
        graphs_traced=1,
        pieces=2 * layers + 1,
        compiled_pieces=layers + 1,
        backend_compilations=(layers + 1) * len(expected_artifacts),
        eager_compiles=0,
    ):
        for n in (3, 2, 16, 17, 64):
            ids, pos = toy_llama.example_inputs(n)
            with torch.no_grad():
                torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    assert tessera.counters.snapshot()["inductor_compiles"] > 0
    # Size 1: the trace is size-oblivious and the model does not treat 1 apart, so the range
    # [1,8] serves it; nothing more is traced or compiled.
    with tessera.counters.expect(graphs_traced=0, backend_compilations=0):
        for _ in range(2):
            ids, pos = toy_llama.example_inputs(1)
            with torch.no_grad():
                torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    for record in compiled.pieces:
        if not record.is_splitting:
            assert record.artifacts == expected_artifacts
            assert dict(record.served) == {"general": 0, "size 16": 1, "range [1,8]": 4, "range [9,max]": 2}


def test_trace_once_inductor_general_artifact_serves_every_size():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, mode="trace_once", backend="inductor")
    for n in (5, 1, 12):
        ids, pos = toy_llama.example_inputs(n)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    (record,) = compiled.pieces
    assert dict(record.served) == {"general": 3}  # size 1 too: the trace is size-oblivious


class SlidingCache(torch.nn.Module):
    """Grows a cache with ``cat`` as Hugging Face's caches do (the first step cats onto an empty
    1-D tensor) and keeps a window of it (a view of the grown cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        new = self.kv(x).view(batch, length, 4, 8).transpose(1, 2)
        grown = torch.cat([cache, new], dim=-2)
        return torch.nn.functional.scaled_dot_product_attention(new, grown, grown), grown[:, :, -6:]


def test_compiled_outputs_keep_eagers_layout_cold_and_warm(tmp_path):
    """Inductor compiles ``cat`` with an empty tensor to a copy of the other input in that input's
    layout; eager returns a contiguous tensor. A cache fed back to the model must be laid out as
    eager lays it out, or a process serving compiled pieces meets calls its traces did not see."""
    torch.manual_seed(0)
    model = SlidingCache().eval().requires_grad_(False)
    for process in ("cold", "warm"):
        torch._dynamo.reset()
        compiled = tessera.compile(model, backend="inductor", cache_dir=str(tmp_path))
        for batch, length in ((2, 7), (3, 9)):
            x = torch.randn(batch, length, 32)
            empty = torch.tensor([])  # what a lazily initialised Hugging Face cache holds
            got, expected = compiled(x, empty), model(x, empty)
            for a, b in zip(got, expected, strict=True):
                torch.testing.assert_close(a, b)
                assert a.stride() == b.stride(), (process, batch, length, a.stride(), b.stride())
        assert compiled.warm_start == (process == "warm")
