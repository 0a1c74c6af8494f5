"""The call check derived from Dynamo's guards: every change Dynamo would have caught is caught.

Each case compiles a small function or module, calls it once, then calls it with one thing
changed: the result equals eager, or the call is refused with a TesseraError. Never a silent
wrong result.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest
import torch

import tessera
from tessera.errors import TesseraError


def served_or_refused(compiled: Callable[..., Any], fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """'served' when the compiled call equals eager, 'refused' when it raises a TesseraError.
    Eager runs on a copy of the arguments: a model that changes them must see them as passed."""
    copied_args, copied_kwargs = copy.deepcopy((args, kwargs))
    expected = fn(*copied_args, **copied_kwargs)
    try:
        got = compiled(*args, **kwargs)
    except TesseraError:
        return "refused"
    torch.testing.assert_close(got, expected)
    return "served"


def compile_eager(fn: Callable[..., Any], **options: Any) -> tessera.CompiledModel:
    return tessera.compile(fn, backend="eager", **options)


def with_extra(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    return x * 2 + sum(rest, torch.zeros(()))


def test_extra_positional_arguments_are_not_dropped():
    compiled = compile_eager(with_extra)
    x = torch.randn(4, 3)
    compiled(x)
    assert served_or_refused(compiled, with_extra, x, torch.ones(4, 3)) == "refused"
    assert served_or_refused(compiled, with_extra, torch.randn(6, 3)) == "served"


def appends(x: torch.Tensor, out: list) -> torch.Tensor:
    y = x + len(out)
    out.append(y)
    return y


def test_the_check_is_recorded_before_the_first_call_runs():
    compiled = compile_eager(appends)
    x = torch.randn(4)
    first: list = []
    compiled(x, first)
    assert len(first) == 1
    # A call identical to the first (an empty list) is served; one with another length is not.
    assert served_or_refused(compiled, appends, x, []) == "served"
    assert served_or_refused(compiled, appends, x, [1, 2]) == "refused"


class Mode(enum.Enum):
    ADD = 1
    MUL = 2


def combine(x: torch.Tensor, mode: Mode) -> torch.Tensor:
    return x + 1 if mode is Mode.ADD else x * 3


def apply(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return fn(x) + 1


def by_int_key(x: torch.Tensor, table: dict) -> torch.Tensor:
    return x * table[3]


def nested(x: torch.Tensor, deep: list) -> torch.Tensor:
    return x * deep[0][0][0][0]["scale"]


@dataclasses.dataclass
class Box:
    t: torch.Tensor
    scale: float


def boxed(x: torch.Tensor, box: Box) -> torch.Tensor:
    return x * box.scale + box.t


@pytest.mark.parametrize(
    ("fn", "first", "changed"),
    [
        (combine, (Mode.ADD,), (Mode.MUL,)),
        (apply, (torch.relu,), (torch.tanh,)),
        (by_int_key, ({3: 2.0},), ({3: 5.0},)),
        (by_int_key, (OrderedDict([(3, 2.0)]),), (OrderedDict([(3, 4.0)]),)),
        (nested, ([[[[{"scale": 2.0}]]]],), ([[[[{"scale": 7.0}]]]],)),
        (boxed, (Box(torch.ones(4), 2.0),), (Box(torch.ones(4), 3.0),)),
        (boxed, (Box(torch.ones(4), 2.0),), (Box(torch.ones(4, dtype=torch.float64), 2.0),)),
        (boxed, (Box(torch.ones(4), 2.0),), (Box(torch.ones(1), 2.0),)),
    ],
    ids=[
        "enum",
        "function",
        "int-key dict",
        "OrderedDict",
        "depth 5",
        "dataclass float",
        "dataclass dtype",
        "dataclass size",
    ],
)
def test_a_changed_argument_is_refused_not_served_as_the_first(fn, first, changed):
    compiled = compile_eager(fn, dynamic_dims={"x": 0})
    x = torch.randn(3, 4)
    assert served_or_refused(compiled, fn, x, *first) == "served"
    assert served_or_refused(compiled, fn, torch.randn(5, 4), *first) == "served"
    assert served_or_refused(compiled, fn, x, *changed) == "refused"


def loops_over_dim0(x: torch.Tensor) -> torch.Tensor:
    out = x
    for i in range(x.shape[0]):
        out = out + i
    return out


def adds(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_sizes_the_code_fixes_and_relations_between_sizes_are_checked(backend):
    looped = tessera.compile(loops_over_dim0, backend=backend)
    assert served_or_refused(looped, loops_over_dim0, torch.randn(3, 2)) == "served"
    assert served_or_refused(looped, loops_over_dim0, torch.randn(5, 2)) == "refused"
    added = tessera.compile(adds, backend=backend)
    assert served_or_refused(added, adds, torch.randn(4, 2), torch.randn(4, 2)) == "served"
    assert served_or_refused(added, adds, torch.randn(6, 2), torch.randn(6, 2)) == "served"
    # Broadcasting a size-1 y: eager's numbers (a graph that runs broadcasts too) or refused, never
    # a kernel that reads y as if it had x's size.
    assert served_or_refused(added, adds, torch.randn(4, 2), torch.randn(1, 2)) in ("served", "refused")


def test_a_closure_float_and_a_config_value_held_by_the_module_are_checked():
    scale = 2.0

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * scale

    compiled = compile_eager(scaled)
    x = torch.randn(4)
    assert served_or_refused(compiled, scaled, x) == "served"
    scale = 3.0
    assert served_or_refused(compiled, scaled, x) == "refused"

    class Config:
        scale = 2.0

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cfg = Config()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.cfg.scale

    model = Scaled()
    compiled_model = compile_eager(model)
    assert served_or_refused(compiled_model, model, x) == "served"
    model.cfg.scale = 5.0
    assert served_or_refused(compiled_model, model, x) == "refused"


def times(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * alpha if not math.isnan(alpha) else x


def test_a_nan_argument_serves_the_identical_call():
    compiled = compile_eager(times)
    x = torch.randn(4)
    assert served_or_refused(compiled, times, x, float("nan")) == "served"
    assert served_or_refused(compiled, times, x, float("nan")) == "served"
    assert served_or_refused(compiled, times, x, 2.0) == "refused"


def test_a_class_defined_in_a_function_does_not_break_the_call():
    @dataclasses.dataclass
    class Local:
        scale: float

    def scaled(x: torch.Tensor, cfg: Local) -> torch.Tensor:
        return x * cfg.scale

    compiled = compile_eager(scaled)
    x = torch.randn(4)
    assert served_or_refused(compiled, scaled, x, Local(2.0)) == "served"
    assert served_or_refused(compiled, scaled, torch.randn(6), Local(2.0)) == "served"
    assert compiled.report is not None and "not written" in compiled.report.as_dict()["whole_model_artifact"]
