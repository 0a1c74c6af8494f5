"""CUDA-graph padding, capture state and dispatch, on CPU: a stand-in graph backend records the
function at capture and re-runs it into the captured outputs at replay, as a CUDA graph would."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import tessera
from tessera.compilation.piece import DynamicInputs, SizeSource
from tessera.models import toy_llama
from tessera.serving import cudagraph, pieces as pieces_module
from tessera.serving.cudagraph import CUDAGraphError, CUDAGraphPiece, padded_size


def _flat(value):
    return [value] if isinstance(value, torch.Tensor) else [v for v in value if isinstance(v, torch.Tensor)]


class StandInGraphs:
    """Capture runs the function once; replay runs it again into the same output tensors."""

    def __init__(self) -> None:
        self.firsts: list[bool] = []
        self.replays = 0

    def capture(self, fn, first):
        outputs = fn()
        self.firsts.append(first)
        return (fn, outputs), outputs

    def replay(self, graph) -> None:
        fn, outputs = graph
        for static, fresh in zip(_flat(outputs), _flat(fn()), strict=True):
            static.copy_(fresh)
        self.replays += 1


def test_padded_size_rounds_up_to_the_next_capture_size():
    sizes = (1, 2, 4, 8)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def _piece(debug: bool = False):
    weight = torch.randn(4)

    def fn(x: torch.Tensor, size: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert x.shape[0] == size, "the size argument must follow the padded input"
        return x * 2 + w, w.sum().expand(1)

    dynamic = DynamicInputs(tensor_dims=(0, None, None), symint_positions=(1,), output_dims=(0, None))
    graphs = StandInGraphs()
    piece = CUDAGraphPiece("p", fn, SizeSource(1), dynamic, (2, 4, 8), graphs, first=True, debug=debug)
    return piece, fn, weight, graphs


def test_warm_up_then_capture_then_replay_with_padding():
    piece, fn, weight, graphs = _piece()
    x3 = torch.randn(3, 4)
    with tessera.counters.expect(cudagraphs_captured=0):
        out = piece(x3, 3, weight)  # warm-up: runs the piece as is
    torch.testing.assert_close(out[0], fn(x3, 3, weight)[0])
    with tessera.counters.expect(cudagraphs_captured=1):
        out = piece(x3, 3, weight)  # capture at size 4, replay, slice back to 3
    assert out[0].shape == (3, 4)
    torch.testing.assert_close(out[0], fn(x3, 3, weight)[0])
    torch.testing.assert_close(out[1], weight.sum().expand(1))
    with tessera.counters.expect(cudagraphs_captured=0):  # replays never capture again
        for n in (4, 3, 4, 3):
            x = torch.randn(n, 4)
            torch.testing.assert_close(piece(x, n, weight)[0], fn(x, n, weight)[0])
    x1 = torch.randn(1, 4)
    piece(x1, 1, weight)  # size 1 pads to capture size 2: its warm-up
    with tessera.counters.expect(cudagraphs_captured=1):
        torch.testing.assert_close(piece(x1, 1, weight)[0], fn(x1, 1, weight)[0])
    assert graphs.firsts == [True, False] and set(piece.states) == {2, 4}


def test_size_above_the_largest_capture_size_runs_without_graphs():
    piece, fn, weight, graphs = _piece()
    x = torch.randn(9, 4)
    with tessera.counters.expect(cudagraphs_captured=0):
        for _ in range(3):
            torch.testing.assert_close(piece(x, 9, weight)[0], fn(x, 9, weight)[0])
    assert graphs.replays == 0


def test_debug_mode_rejects_a_fixed_input_at_another_address():
    piece, _, weight, _ = _piece(debug=True)
    x = torch.randn(4, 4)
    piece(x, 4, weight)
    piece(x, 4, weight)  # captured with this weight tensor
    with pytest.raises(CUDAGraphError, match=r"inputs \[2\] are not at the addresses captured"):
        piece(x, 4, weight.clone())


def test_compile_sizes_must_be_capture_sizes():
    with pytest.raises(tessera.ConfigError, match=r"compile_sizes \[3\] are not in cudagraph_capture_sizes"):
        tessera.CompileConfig(
            cudagraph_mode="piecewise", cudagraph_capture_sizes=[1, 2, 4], compile_sizes=[3]
        )


def test_cudagraph_mode_without_cuda_warns_once_and_runs_without_graphs(caplog, monkeypatch):
    monkeypatch.setattr(cudagraph, "_warned", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine runs this test too
    model = toy_llama.build(num_layers=1)
    with caplog.at_level(logging.WARNING, logger="tessera.serving.cudagraph"):
        for _ in range(2):
            compiled = tessera.compile(model, backend="eager", cudagraph_mode="piecewise")
            ids, pos = toy_llama.example_inputs(5)
            with torch.no_grad():
                torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    warnings = [r for r in caplog.records if "needs CUDA" in r.message]
    assert len(warnings) == 1
    assert tessera.counters.snapshot()["cudagraphs_captured"] == 0


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_decode_model_under_stand_in_graphs_matches_eager(mode, monkeypatch):
    graphs = StandInGraphs()
    monkeypatch.setattr(pieces_module, "cuda_graphs_available", lambda mode: True)
    monkeypatch.setattr(pieces_module, "CUDAGraphPool", lambda: graphs)
    capture_sizes = [2, 4, 8]
    model = toy_llama.build_decode(num_layers=2, max_batch=8, max_len=64)
    reference = copy.deepcopy(model)
    compiled = tessera.compile(
        model, backend="eager", cudagraph_mode=mode, cudagraph_capture_sizes=capture_sizes
    )
    # Full graphs run attention on padded rows too, so "full" is exercised at capture sizes only.
    batches = [8, 3, 5, 8, 2, 7] if mode == "piecewise" else [8, 4, 2, 8, 4, 2]
    generator = torch.Generator().manual_seed(0)
    for step in range(12):
        batch = batches[step % len(batches)]
        ids = torch.randint(0, 256, (batch,), generator=generator)
        pos = torch.full((batch,), step)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, pos), reference(ids, pos))
    compiled_pieces = sum(not p.is_splitting for p in compiled.pieces)
    assert compiled_pieces == (3 if mode == "piecewise" else 1)
    assert tessera.counters.snapshot()["cudagraphs_captured"] == compiled_pieces * len(capture_sizes)
    assert graphs.firsts.count(True) == 1  # gc/empty_cache kept only for the very first capture
    assert all(p.cudagraph_sizes == tuple(capture_sizes) for p in compiled.pieces if not p.is_splitting)


@pytest.mark.inductor
def test_defaults_serve_eagerly_then_capture_the_compiled_pieces_under_stand_in_graphs(monkeypatch):
    """Background compile and eager first (an option) with CUDA graphs on: the first calls are
    eager's while the trace and the compile run beside them, then the compiled pieces are captured
    once per capture size in use; every output equals eager's."""
    monkeypatch.delenv("TESSERA_BACKGROUND_COMPILE")  # the suite's choice (conftest.py), not a default
    monkeypatch.setenv("TESSERA_EAGER_FIRST", "1")
    graphs = StandInGraphs()
    monkeypatch.setattr(pieces_module, "cuda_graphs_available", lambda mode: True)
    monkeypatch.setattr(pieces_module, "CUDAGraphPool", lambda: graphs)
    model = toy_llama.build_decode(num_layers=2, max_batch=8, max_len=64)
    reference = copy.deepcopy(model)
    compiled = tessera.compile(model, cudagraph_mode="piecewise", cudagraph_capture_sizes=[1, 2, 4, 8])
    generator = torch.Generator().manual_seed(0)
    for step in range(20):
        if step == 4:
            assert compiled.wait_ready(300)
        batch = [8, 3, 5, 1][step % 4]  # 3 pads to 4, 5 to 8
        ids = torch.randint(0, 256, (batch,), generator=generator)
        pos = torch.full((batch,), step)
        torch.testing.assert_close(compiled(ids, pos), reference(ids, pos))  # grad enabled
    counts = tessera.counters.snapshot()
    assert counts["served_eagerly"] == 4
    compiled_pieces = sum(not p.is_splitting for p in compiled.pieces)
    assert counts["cudagraphs_captured"] == compiled_pieces * 3  # sizes 8, 4 and 1
