"""Shapes listed in compile_sizes (``[(4, 128)]``: batch x length): read against each trace as
the leading dims of the model's input, compiled for the pieces that vary in those sizes, served
for exactly those calls, loaded by the next process; listed sizes where pieces vary in two."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import tessera
from tessera.config import CompileConfig
from tessera.errors import ConfigError, TesseraWarning
from tests.child import run_json


class FourInputs(torch.nn.Module):
    """Attention over ``x [batch, length, 8]``, the fourth argument: Dynamo names its sizes by a
    hash of where they are read (torch 2.13: the batch ``s99``, the length ``s7``), so by name the
    length would come first."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, scale, unused_a, unused_b, x):
        y = self.proj(x) * scale
        y = torch.nn.functional.scaled_dot_product_attention(y[:, None], y[:, None], y[:, None])[:, 0]
        return self.proj(y)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return FourInputs().eval().requires_grad_(False)  # served frozen; grad mode stays on


def _call(compiled, model, batch: int, length: int) -> None:
    x = torch.randn(batch, length, 8)
    scale = torch.full((8,), 0.5)
    torch.testing.assert_close(compiled(scale, None, None, x), model(scale, None, None, x))


def _served(compiled) -> dict[tuple[int, ...] | int, set[str]]:
    out: dict[tuple[int, ...] | int, set[str]] = {}
    for size, label, _ in compiled.report.sizes_served:
        out.setdefault(size, set()).add(label)
    return out


SHAPES = [(2, 5), (3, 7), (4, 6), (3, 7), (2, 9), (5, 3), (4, 6), (6, 7)]


def test_listed_shapes_serve_their_calls_batch_first_and_load_warm(tmp_path: Path):
    model = _model()
    compiled = tessera.compile(
        model, backend="eager", compile_sizes=[(3, 7), (4, 6)], cache_dir=tmp_path, background_compile=False
    )
    for batch, length in SHAPES:
        _call(compiled, model, batch, length)
    served = _served(compiled)
    # Counted and labelled batch first, as listed, whatever the symbols' names.
    assert served[(3, 7)] == {"shape 3x7"} and served[(4, 6)] == {"shape 4x6"}, served
    assert served[(2, 9)] == served[(5, 3)] == served[(6, 7)] == {"general"}, served
    again = tessera.compile(
        model, backend="eager", compile_sizes=[(3, 7), (4, 6)], cache_dir=tmp_path, background_compile=False
    )
    for batch, length in [(3, 7), (4, 6), (6, 7), (7, 3)]:
        _call(again, model, batch, length)
    assert again.warm_start is True
    served = _served(again)
    assert served[(3, 7)] == {"shape 3x7"} and served[(4, 6)] == {"shape 4x6"}, served
    assert served[(7, 3)] == {"general"}, served


def test_a_shape_whose_batch_a_trace_fixed_compiles_its_length_there():
    """The first trace fixes the length (5) and varies the batch: a listed (4, 5) is size 4 of
    that trace's pieces, and (4, 6) is not its (its length is not 5)."""
    model = _model()
    compiled = tessera.compile(
        model, backend="eager", compile_sizes=[(4, 5), (4, 6)], background_compile=False
    )
    for batch in (2, 4, 3, 4):
        _call(compiled, model, batch, 5)
    served = _served(compiled)
    assert served[4] == {"size 4"} and served[2] == served[3] == {"general"}, served


class Channels(torch.nn.Module):
    """Audio-like ``x [batch, 3, time]``: the shape gives the dims that vary, (batch, time); the
    channels may be given too, ``(batch, 3, time)``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(3, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(y[:, None], y[:, None], y[:, None])[:, 0]
        return y.sum(-1)


class PositionsFirst(torch.nn.Module):
    """``pos [length]`` is used before ``x [batch, length, 8]``: the shapes are read against the
    first input they fit."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, pos):
        scale = pos.float().mean()
        y = self.proj(x) + scale
        y = torch.nn.functional.scaled_dot_product_attention(y[:, None], y[:, None], y[:, None])[:, 0]
        return self.proj(y)


@pytest.mark.parametrize("listed", [(4, 16), (4, 3, 16)])
def test_a_shape_gives_the_dims_that_vary_and_may_give_the_fixed_ones_too(listed):
    model = Channels().eval().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager", compile_sizes=[listed], background_compile=False)
    for batch, time in [(2, 10), (4, 16), (3, 9), (4, 16), (4, 17)]:
        x = torch.randn(batch, 3, time)
        torch.testing.assert_close(compiled(x), model(x))
    served = _served(compiled)
    assert served[(4, 16)] == {"shape 4x16"} and served[(4, 17)] == {"general"}, served


def test_shapes_are_read_against_the_first_input_they_fit():
    model = PositionsFirst().eval().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager", compile_sizes=[(4, 6)], background_compile=False)
    for batch, length in [(2, 5), (4, 6), (3, 7), (4, 6)]:
        x, pos = torch.randn(batch, length, 8), torch.arange(length)
        torch.testing.assert_close(compiled(x, pos), model(x, pos))
    # pos's length is a size of its own (nothing ties it to x's): the piece that reads x serves
    # (4, 6) from the shape, the one that reads pos from its general artifact.
    served = {label: n for runner in compiled.runners.values() for label, n in runner.served() if n}
    assert served.get("shape 4x6") == 2, served


def test_a_trace_that_varies_in_two_dims_and_fits_no_listed_shape_says_so():
    model = _model()
    compiled = tessera.compile(model, backend="eager", compile_sizes=[(3, 7, 8, 1)], background_compile=False)
    with pytest.warns(TesseraWarning, match="no shape in compile_sizes fits this trace"):
        for batch, length in SHAPES:
            _call(compiled, model, batch, length)


def test_listed_sizes_where_pieces_vary_in_two_sizes_are_said_once_and_every_call_served():
    model = _model()
    compiled = tessera.compile(model, backend="eager", compile_sizes=[4, (3, 7)], background_compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch, length in SHAPES:
            _call(compiled, model, batch, length)
    said = [w for w in caught if issubclass(w.category, TesseraWarning) and "List shapes" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "(4, 128)" in str(said[0].message) and "args[3]" in str(said[0].message)


@pytest.mark.parametrize(
    ("sizes", "words"),
    [
        ([(3,)], "two or more integers"),
        ([(0, 5)], "two or more integers"),
        ([(2, "x")], "two or more integers"),
        ([(2, 5), [2, 5]], "twice"),
        ("4x128", "must be a list"),
    ],
)
def test_bad_shapes_are_config_errors(sizes, words):
    with pytest.raises(ConfigError, match=words):
        CompileConfig(compile_sizes=sizes)


def test_shapes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TESSERA_COMPILE_SIZES", "1, 4x128, 2x16, auto")
    config = CompileConfig()
    assert config.sizes == (1,) and config.shapes == ((2, 16), (4, 128)) and config.auto_sizes > 0
    monkeypatch.setenv("TESSERA_COMPILE_SIZES", "4x")
    with pytest.raises(ConfigError, match="4x128"):
        CompileConfig()


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_compiles_listed_shapes_cold_and_loads_them_warm_on_the_defaults(tmp_path: Path):
    """A BERT whose calls vary in batch and length, its hot shapes listed, on the defaults
    (Inductor, background compile, eager first) in two fresh processes: the first compiles the
    listed shapes and serves them; the second loads them and compiles nothing. Every output is
    eager's (the helper compares)."""
    defaults = {"TESSERA_BACKGROUND_COMPILE": "1", "TESSERA_COMPILE_WORKERS": ""}
    cold = run_json("tests.run_auto_sizes", "inductor", "shapes-listed", cache=tmp_path, **defaults)
    assert cold["learnt"] == [] and cold["counters"]["inductor_compiles"] > 0
    assert {"shape 2x16", "shape 4x8"} <= set(cold["served_by"]), cold["served_by"]
    assert {"shape 2x16", "shape 4x8"} <= set(cold["by_worker"]), cold["by_worker"]  # off the GIL
    assert cold["warnings"] == [], cold["warnings"]  # no CacheWarning, no shape left unfitted
    # The warm process serves under torch.inference_mode(), as a server calls.
    warm = run_json(
        "tests.run_auto_sizes",
        "inductor",
        "shapes-listed",
        cache=tmp_path,
        AUTO_SIZES_INFERENCE_MODE="1",
        **defaults,
    )
    assert warm["first_kind"] == "warm" and warm["counters"]["inductor_compiles"] == 0
    assert warm["counters"]["graphs_traced"] == 0 and warm["warnings"] == [], warm
    assert {"shape 2x16", "shape 4x8"} <= set(warm["served_by"]), warm["served_by"]
