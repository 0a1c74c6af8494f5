"""A piece's inputs as saved for a later compile (tessera.compilation.piece_inputs): what a warm process makes
its example inputs from when it learns a size."""

from __future__ import annotations

import pickle

import pytest
import torch

import tessera
from tessera.compilation.piece_inputs import SavedInput, SavedInputs, inputs_at
from tessera.config import Shape
from tessera.errors import ConfigError


class Rows(torch.nn.Module):
    """x: [2, n] (strides (n, 1): a size symbol in a stride), and a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(2, 1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).relu().sum(0)


def test_a_traced_piece_saves_its_inputs_and_they_make_example_inputs_at_any_size():
    model = Rows()
    compiled = tessera.compile(model, backend="eager", compile_sizes="auto", dynamic_dims={"x": 1})
    for n in (5, 9):
        x = torch.randn(2, n)  # grad enabled: PyTorch's default state
        torch.testing.assert_close(compiled(x), model(x))
    (record,) = [p for p in compiled.pieces if not p.is_splitting]
    saved = pickle.loads(pickle.dumps(record.inputs))  # as the whole-model artifact holds it
    assert isinstance(saved, SavedInputs) and len(saved.symbols) == 1
    tensors = [i for i in saved.inputs if i.kind == "tensor"]
    symbolic = [i for i in tensors if any(isinstance(d, str) for d in (*i.shape, *i.stride))]
    assert len(symbolic) == 1 and symbolic[0].dtype == torch.float32
    made = inputs_at(record.name, saved, 7)
    rows = next(t for t, i in zip(made, saved.inputs, strict=True) if i is symbolic[0])
    assert rows.shape == (2, 7) and rows.stride() == (7, 1) and not rows.any()
    weight = next(
        t for t, i in zip(made, saved.inputs, strict=True) if i.kind == "tensor" and i.shape == (2, 1)
    )
    assert weight.shape == (2, 1)


def test_a_shape_needs_one_value_per_size_symbol():
    saved = SavedInputs(
        (SavedInput("tensor", shape=("s0", "s1"), stride=("s1", 1), dtype=torch.float16, device="cpu"),),
        ("s0", "s1"),
    )
    (made,) = inputs_at("p", saved, Shape((3, 4)))
    assert made.shape == (3, 4) and made.stride() == (4, 1) and made.dtype == torch.float16
    with pytest.raises(ConfigError, match="one value for each"):
        inputs_at("p", saved, Shape((3,)))
    with pytest.raises(ConfigError, match="exactly one dynamic size"):
        inputs_at("p", saved, 3)


def test_a_calls_own_weight_is_given_to_the_compile_and_a_size_that_cannot_fit_is_refused(monkeypatch):
    from tessera.compilation import piece_inputs

    saved = SavedInputs(
        (
            SavedInput("tensor", shape=("s0", 4), stride=(4, 1), dtype=torch.float32, device="cpu"),
            SavedInput("tensor", shape=(4, 4), stride=(4, 1), dtype=torch.float32, device="cpu"),
            SavedInput("size", expr="2*s0"),
        ),
        ("s0",),
    )
    weight = torch.randn(4, 4)
    rows, same, doubled = inputs_at("p", saved, 3, real=(None, weight))
    assert same is weight and rows.shape == (3, 4) and doubled == 6
    _, made, _ = inputs_at("p", saved, 3, real=(None, weight.t()))  # not as traced: one is made
    assert made is not weight and made.shape == (4, 4) and made.stride() == (4, 1)
    monkeypatch.setattr(piece_inputs, "device_memory", lambda device: 64)
    with pytest.raises(ConfigError, match="GiB of example inputs on cpu"):
        inputs_at("p", saved, 1000, real=(None, weight))
