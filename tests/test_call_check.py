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
import types
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
    """The check alone: ``max_traces=1`` refuses what it catches (by default it is traced again,
    see test_traces.py)."""
    return tessera.compile(fn, backend="eager", **{"max_traces": 1, **options})


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
    # The code fixes the size: another size gets a trace of its own (as torch.compile recompiles).
    assert served_or_refused(looped, loops_over_dim0, torch.randn(5, 2)) == "served"
    assert len(looped.traces) == 2
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


# Module-level values a forward reads through a dict key and a nested function's closure cell:
# Dynamo bakes both into the graph, as a script setting them from its environment would.
SETTINGS = {"k": 2.0}


def _make_leaky(slope: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def leaky(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, x, x * slope)

    return leaky


LEAKY = _make_leaky(0.1)


def settled(x: torch.Tensor) -> torch.Tensor:
    return LEAKY(x) * SETTINGS["k"]


def test_module_level_dict_items_and_closure_cells_are_checked(monkeypatch):
    compiled = compile_eager(settled)
    x = torch.randn(6)
    assert served_or_refused(compiled, settled, x) == "served"
    monkeypatch.setitem(SETTINGS, "k", 3.0)
    assert served_or_refused(compiled, settled, x) == "refused"
    monkeypatch.setitem(SETTINGS, "k", 2.0)
    monkeypatch.setattr(LEAKY.__closure__[0], "cell_contents", 0.3)  # type: ignore[index]
    assert served_or_refused(compiled, settled, x) == "refused"
    with pytest.raises(TesseraError, match=r"test_call_check\.LEAKY\.__closure__\[0\]\.cell_contents"):
        compiled(x)


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


# -- aliasing, small sizes, dispatch, config values, nesting, the warm fingerprint --------------------
def adds_then_views(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x.view(-1)


def adds_then_slices(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x[1:]


def transposes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.t(), x * 2


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_an_output_that_views_an_input_in_eager_views_it_compiled(backend):
    for fn in (adds_then_views, adds_then_slices, transposes):
        compiled = tessera.compile(fn, backend=backend)
        for rows in (4, 5, 7):
            x, expected_x = torch.zeros(rows, 3), torch.zeros(rows, 3)
            out, expected = compiled(x), fn(expected_x)
            first, expected_first = (out[0], expected[0]) if isinstance(out, tuple) else (out, expected)
            torch.testing.assert_close(out, expected)
            first.add_(10)  # a write through the output reaches the argument, as in eager
            expected_first.add_(10)
            torch.testing.assert_close(x, expected_x, msg=f"{fn.__name__}, {rows} rows")
    # A warm start keeps the views: the replay is part of the saved split module.
    warm = tessera.compile(adds_then_slices, backend=backend)
    x = torch.zeros(6, 3)
    warm(x).add_(10)
    assert warm.warm_start is True
    assert x[0].sum().item() == 3 and x[1:].sum().item() == 5 * 3 * 11


def squeezes(x: torch.Tensor) -> torch.Tensor:
    return x.squeeze() * 2


def branches_on_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 if x.shape[0] == 1 else x * 3


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_model_that_treats_size_one_apart_gets_a_trace_for_it(backend):
    """Size 1 is served by the general trace unless the model treats it apart: a squeeze (found in
    the graph) or a branch on it (a guard). Those get a second trace, and equal eager."""
    for fn in (squeezes, branches_on_one):
        compiled = tessera.compile(fn, backend=backend, disable_cache=True)
        for rows in (3, 4, 1, 5, 1):
            x = torch.randn(rows, 1, 3)
            torch.testing.assert_close(compiled(x), fn(x), msg=f"{fn.__name__} at {rows} rows")
        assert len(compiled.traces) == 2, "one general trace, one for size 1"
    # A first call at size 1 gets the trace for size 1; the general one comes with size 3.
    compiled = tessera.compile(squeezes, backend=backend, disable_cache=True)
    for rows in (1, 3, 1, 6):
        x = torch.randn(rows, 1, 3)
        torch.testing.assert_close(compiled(x), squeezes(x))
    assert len(compiled.traces) == 2


class LoopsOverRows(torch.nn.Module):
    """Code that fixes the size of its dynamic dim: a Python loop over the rows (as Mamba's and
    RWKV's CPU paths loop over the sequence). One graph cannot serve every size."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = torch.zeros_like(x[0])
        rows = []
        for i in range(x.shape[0]):
            state = self.scale(state) * 0.5 + x[i]
            rows.append(state)
        return torch.stack(rows)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_code_that_fixes_a_dynamic_size_is_traced_once_per_size(backend):
    model = LoopsOverRows()  # grad enabled, parameters requiring grad: the call is refused...
    x = torch.randn(4, 3)
    with pytest.raises(tessera.GradientsNotSupportedError):
        tessera.compile(model, backend=backend, disable_cache=True)(x)
    model.requires_grad_(False)  # ...and served once nothing needs gradients
    compiled = tessera.compile(model, backend=backend, disable_cache=True)
    torch.testing.assert_close(compiled(x), model(x))  # a guessed dim: Dynamo keeps it static
    torch.testing.assert_close(compiled(x[:3]), model(x[:3]))
    for rows in (4, 6, 1, 6, 9, 4, 3):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(compiled(x), model(x), msg=f"{rows} rows")
    assert not hasattr(x, "_dynamo_dynamic_indices"), (
        "tessera's dim marks must not stay on the caller's tensor"
    )
    # One trace per distinct size (4, 3, 6, 1, 9); repeats are served by their own.
    assert len(compiled.traces) == 5
    # Dims the user marked dynamic: Dynamo's trace fails on them, and each size is traced alone.
    marked = tessera.compile(model, backend=backend, disable_cache=True, dynamic_dims={"x": 0})
    torch.testing.assert_close(marked(x), model(x))
    for rows in (5, 3, 5):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(marked(x), model(x), msg=f"{rows} rows")
    assert len(marked.traces) == 2  # sizes 3 and 5


def test_traces_per_size_are_loaded_by_the_next_start():
    model = LoopsOverRows().requires_grad_(False)
    for attempt in ("first", "next"):
        torch._dynamo.reset()
        tessera.counters.reset()
        compiled = tessera.compile(model, backend="eager", dynamic_dims={"x": 0})
        for rows in (5, 3):
            x = torch.randn(rows, 3)
            torch.testing.assert_close(compiled(x), model(x))
        compiled.wait_ready()
        traced = tessera.counters.snapshot().get("graphs_traced", 0)
        # The first start fails the general trace (before a graph), then traces sizes 5 and 3;
        # the next loads both.
        assert traced == (2 if attempt == "first" else 0), attempt
    assert compiled.warm_start is True and [e.loaded for e in compiled.traces] == [True, True]


def test_calls_past_max_traces_are_refused_naming_every_trace():
    model = LoopsOverRows().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager", disable_cache=True, max_traces=2)
    for rows in (2, 3, 2):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(compiled(x), model(x))
    with pytest.raises(
        tessera.InputMismatchError, match=r"2 trace\(s\), the limit \(trace 1: the first call; trace 2: x: "
    ):
        compiled(torch.randn(4, 3))
    x = torch.randn(3, 3)  # the traces made still serve
    torch.testing.assert_close(compiled(x), model(x))


def cat_then_attention(x: torch.Tensor) -> torch.Tensor:
    y = torch.cat([x, x]) * 1.5
    y = torch.ops.silly.attention(y, y, y)
    return y.sum(-1, keepdim=True) + y * 2


@pytest.mark.inductor
def test_pieces_dispatch_on_the_dynamic_size_not_a_size_derived_from_it():
    compiled = tessera.compile(cat_then_attention, backend="inductor", compile_sizes=[8], disable_cache=True)
    for rows in (5, 4, 8, 3, 16):
        x = torch.randn(rows, 3)
        torch.testing.assert_close(compiled(x), cat_then_attention(x), msg=f"{rows} rows")
    for piece in compiled.pieces:
        if not piece.is_splitting and piece.sizes:
            assert dict(piece.served)["size 8"] == 1, f"{piece.name}: only the call with 8 rows is size 8"


def sums_both(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.sum(0) + y.sum(0)


def test_compile_sizes_that_cannot_work_are_config_errors_and_sizes_of_another_kind_are_said():
    with pytest.raises(tessera.ConfigError, match=">= 1"):
        tessera.compile(squeezes, compile_sizes=[0])
    with pytest.raises(tessera.ConfigError, match="fits in memory"):
        tessera.compile(squeezes, compile_sizes=[2**40])
    # Two independent dynamic sizes: a listed size names one, so it is not compiled for them (said
    # once, with what to list instead), and the call is served.
    compiled = tessera.compile(sums_both, backend="eager", compile_sizes=[4], disable_cache=True)
    a, b = torch.randn(5, 3), torch.randn(7, 3)
    with pytest.warns(tessera.TesseraWarning, match="List shapes instead"):
        torch.testing.assert_close(compiled(a, b), sums_both(a, b))


def test_a_compile_size_whose_inputs_exceed_memory_is_a_config_error(monkeypatch):
    from tessera.compilation import piece

    monkeypatch.setattr(piece, "device_memory", lambda device: 1024)
    compiled = tessera.compile(cat_then_attention, backend="eager", compile_sizes=[4096], disable_cache=True)
    with pytest.raises(tessera.ConfigError, match="drop 4096 from compile_sizes"):
        compiled(torch.randn(5, 3))


class Doubles(torch.nn.Module):
    def __init__(self, inner: Callable[..., Any]) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


def test_a_tessera_model_called_from_compiled_code_is_inlined():
    linear = torch.nn.Linear(3, 3).requires_grad_(False)
    inner = compile_eager(linear)
    x = torch.randn(4, 3)
    # Inside another tessera model: one graph, as a nested torch.compile would give.
    outer = compile_eager(Doubles(inner))
    assert served_or_refused(outer, lambda x: linear(x) * 2, x) == "served"
    # First called inside a torch.compile'd function.
    stock = torch.compile(lambda x: inner(x) + 1, backend="eager")
    torch.testing.assert_close(stock(x), linear(x) + 1)
    # A function calling itself through its compiled name.
    holder: dict[str, Any] = {}

    def recurses(x: torch.Tensor, depth: int) -> torch.Tensor:
        return holder["compiled"](x, depth - 1) + 1 if depth > 0 else x * 2

    holder["compiled"] = compile_eager(recurses)
    torch.testing.assert_close(holder["compiled"](x, 2), x * 2 + 2)  # its first call: no hang


class PlainConfig:
    def __init__(self, scale: float) -> None:
        self.scale = scale


class Scaled(torch.nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.cfg = PlainConfig(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cfg.scale


def test_the_warm_fingerprint_covers_values_the_model_holds_in_plain_objects():
    x = torch.randn(4)
    first = compile_eager(Scaled(2.0))
    assert served_or_refused(first, Scaled(2.0), x) == "served"
    other = compile_eager(Scaled(3.0))  # as a new process with another config would build it
    assert served_or_refused(other, Scaled(3.0), x) == "served"
    assert other.warm_start is False
    same = compile_eager(Scaled(2.0))
    assert served_or_refused(same, Scaled(2.0), x) == "served"
    assert same.warm_start is True


def test_the_warm_fingerprint_covers_the_attention_implementation():
    transformers = pytest.importorskip("transformers")
    from tessera.cache.key import describe

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    config._attn_implementation = "eager"
    eager = describe(config, held=True)
    config._attn_implementation = "sdpa"
    assert describe(config, held=True) != eager


class ReadsModelOutput(torch.nn.Module):
    def forward(self, x: torch.Tensor, encoder_outputs: Any) -> torch.Tensor:
        # A ModelOutput is a dict and a tuple: Dynamo sees one tensor through two sources.
        return x + encoder_outputs.last_hidden_state.sum(1) + encoder_outputs[0].mean(1)


def test_a_model_output_argument_of_another_length_is_refused_clearly():
    outputs = pytest.importorskip("transformers.modeling_outputs")
    model = ReadsModelOutput()
    compiled = compile_eager(model, dynamic_dims={})
    x = torch.randn(2, 4)

    def encoded(length: int) -> Any:
        return outputs.BaseModelOutput(last_hidden_state=torch.randn(2, length, 4))

    assert served_or_refused(compiled, model, x, encoded(7)) == "served"
    assert served_or_refused(compiled, model, x, encoded(7)) == "served"
    with pytest.raises(tessera.InputMismatchError, match="shape"):
        compiled(x, encoded(9))


def test_layout_density_without_private_apis():
    from tessera.compilation.layout import is_dense

    x = torch.randn(4, 3, 2)
    assert is_dense(x) and is_dense(x.permute(2, 0, 1)) and is_dense(x[:1]) and is_dense(x[:0])
    assert not is_dense(x[:, ::2]) and not is_dense(x.expand(2, 4, 3, 2)) and not is_dense(x[:, :, :1])


def sums_rows(x: torch.Tensor) -> torch.Tensor:
    return x.sum(-1) * x.shape[0]


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_strided_first_call_is_traced_and_checked(backend):
    compiled = tessera.compile(sums_rows, backend=backend, disable_cache=True)
    base = torch.randn(6, 4)
    assert served_or_refused(compiled, sums_rows, base[:, :2]) == "served"
    assert served_or_refused(compiled, sums_rows, torch.randn(5, 4)[:, :2]) == "served"
    assert served_or_refused(compiled, sums_rows, torch.randn(5, 2)) in ("served", "refused")


# -- a call in another syntax: served by the trace it matches, its rewrite worked out once ---------
class Flag(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: bool = True) -> torch.Tensor:
        return x * 2 if scale else x + 1


def mix(x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    return x * alpha + y * beta


def counting_rewrites(monkeypatch) -> list[tuple[int, tuple[str, ...]]]:
    """Each call shape ``call_args.rewrite`` works out, in order (the routing reads it by name)."""
    from tessera.trace import call_args

    made: list[tuple[int, tuple[str, ...]]] = []
    real = call_args.rewrite

    def counted(signature, spec, num_args, keywords):
        made.append((num_args, keywords))
        return real(signature, spec, num_args, keywords)

    monkeypatch.setattr(call_args, "rewrite", counted)
    return made


@pytest.mark.parametrize("grad", [True, False], ids=["grad enabled", "no_grad"])
def test_a_call_in_another_syntax_is_served_by_the_trace_it_matches(grad):
    model = Flag().eval()
    compiled = tessera.compile(model, backend="eager", disable_cache=True)
    x = torch.randn(4, 3)
    with torch.set_grad_enabled(grad):
        assert served_or_refused(compiled, model, x, True) == "served"
        with tessera.counters.expect(graphs_traced=0):
            for _ in range(3):
                assert served_or_refused(compiled, model, x, scale=True) == "served"
                assert served_or_refused(compiled, model, x) == "served"  # the default: True
                assert served_or_refused(compiled, model, x=x, scale=True) == "served"
                assert served_or_refused(compiled, model, scale=True, x=x) == "served"
                assert served_or_refused(compiled, model, x, True) == "served"
    assert len(compiled.traces) == 1


def test_several_arguments_by_keyword_in_any_order_or_left_to_their_default():
    compiled = tessera.compile(mix, backend="eager", disable_cache=True)
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    assert served_or_refused(compiled, mix, x, y, 1.0, beta=0.5) == "served"
    with tessera.counters.expect(graphs_traced=0):
        for _ in range(2):
            assert served_or_refused(compiled, mix, x, y, beta=0.5) == "served"
            assert served_or_refused(compiled, mix, x=x, y=y, beta=0.5, alpha=1.0) == "served"
            assert served_or_refused(compiled, mix, x, y=y, alpha=1.0, beta=0.5) == "served"
            assert served_or_refused(compiled, mix, beta=0.5, y=y, x=x) == "served"
    assert len(compiled.traces) == 1
    # Another value where the trace saw the default: traced again, not served by the first.
    assert served_or_refused(compiled, mix, x, y, alpha=3.0, beta=0.5) == "served"
    assert len(compiled.traces) == 2


def test_the_rewrite_of_a_call_shape_is_worked_out_once(monkeypatch):
    made = counting_rewrites(monkeypatch)
    model = Flag().eval()
    compiled = tessera.compile(model, backend="eager", disable_cache=True)
    x = torch.randn(4, 3)
    compiled(x, True)
    made.clear()
    for _ in range(5):
        assert served_or_refused(compiled, model, x, scale=True) == "served"
        assert served_or_refused(compiled, model, x) == "served"
        with torch.no_grad():
            assert served_or_refused(compiled, model, x, scale=True) == "served"
    assert made == [(1, ("scale",)), (1, ())]  # once per shape, grad enabled or not
    assert len(compiled.traces) == 1


def test_a_remembered_shape_whose_check_fails_goes_the_slow_way():
    """The route of a shape leads to the entry's own check: another value or size is traced (or
    served by the entry that covers it), never served by the remembered entry."""
    model = Flag().eval()
    compiled = tessera.compile(model, backend="eager", disable_cache=True)
    x = torch.randn(4, 3)
    assert served_or_refused(compiled, model, x, True) == "served"
    assert served_or_refused(compiled, model, x, scale=True) == "served"  # remembered
    assert served_or_refused(compiled, model, x, scale=False) == "served"  # another value
    assert len(compiled.traces) == 2
    assert served_or_refused(compiled, model, torch.randn(4, 5), scale=True) == "served"  # another size
    # Three traces made; the first is held back (the third, with the size dynamic, serves its calls).
    assert tessera.counters.snapshot()["graphs_traced"] == 3 and len(compiled.traces) == 2
    for scale in (True, False, True):  # each served by the trace that covers it
        assert served_or_refused(compiled, model, x, scale=scale) == "served"
        assert served_or_refused(compiled, model, x, scale) == "served"
        assert served_or_refused(compiled, model, torch.randn(4, 5), True) == "served"
        assert served_or_refused(compiled, model, torch.randn(4, 6), scale=True) == "served"
    assert tessera.counters.snapshot()["graphs_traced"] == 3 and len(compiled.traces) == 2


def test_an_argument_the_trace_saw_left_to_its_default_is_checked_when_passed():
    model = Flag().eval()
    compiled = tessera.compile(model, backend="eager", disable_cache=True, max_traces=1)
    x = torch.randn(4, 3)
    assert served_or_refused(compiled, model, x) == "served"
    assert served_or_refused(compiled, model, x, scale=True) == "served"  # its default: remembered
    assert served_or_refused(compiled, model, x, True) == "served"
    assert served_or_refused(compiled, model, x, scale=False) == "refused"
    assert served_or_refused(compiled, model, x, False) == "refused"
    assert served_or_refused(compiled, model, x, scale=True) == "served"


def test_call_shapes_are_bounded_and_read_from_many_threads():
    from concurrent.futures import ThreadPoolExecutor

    from tessera.trace import call_args, call_shapes

    routes: call_shapes.ShapeRoutes[Any] = call_shapes.ShapeRoutes(limit=4)
    entry = types.SimpleNamespace(accepts=lambda args, kwargs: True)
    for n in range(1, 10):
        routes.remember((n, ()), entry, call_args.Rewrite((("args", 0),), ()))
    assert len(routes) == 4  # the newest four shapes
    assert routes.find((1,), {}) is None and routes.find((7,) * 9, {}) == call_shapes.Routed(entry, (7,), {})
    model = Flag().eval()
    compiled = tessera.compile(model, backend="eager", disable_cache=True)
    x = torch.randn(4, 3)
    compiled(x, True)

    def call(i: int) -> None:
        kwargs = [{"scale": True}, {}, {"x": x, "scale": True}][i % 3]
        got = compiled(**kwargs) if "x" in kwargs else compiled(x, **kwargs)
        torch.testing.assert_close(got, x * 2)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(call, range(300)))
    assert len(compiled.traces) == 1


def test_calls_found_uncovered_are_known_by_their_look_for_one_set_of_entries():
    from tessera.trace import call_shapes

    uncovered: call_shapes.UncoveredCalls[Any] = call_shapes.UncoveredCalls(limit=3)
    entries, later = (object(),), (object(), object())
    x = torch.randn(4, 3)
    uncovered.add(entries, (x,), {"scale": False})
    assert uncovered.known(entries, (torch.randn(4, 3),), {"scale": False})  # same look
    for other in (
        ((x,), {"scale": True}),  # another value
        ((x,), {}),  # another syntax
        ((torch.randn(4, 5),), {"scale": False}),  # another size
        ((x.t().contiguous().t(),), {"scale": False}),  # another layout
        ((x.double(),), {"scale": False}),  # another dtype
        ((x.requires_grad_(),), {"scale": False}),
    ):
        assert not uncovered.known(entries, *other)
    assert not uncovered.known(later, (x,), {"scale": False}), "another set of entries forgets"
    uncovered.add(later, (x,), {})
    assert not uncovered.known(entries, (x,), {}) and uncovered.known(later, (x,), {})
    for n in range(5):  # bounded
        uncovered.add(later, (torch.randn(n + 1),), {})
    known = [uncovered.known(later, (torch.randn(n + 1),), {}) for n in range(5)]
    assert known == [True, True, False, False, False]


def test_the_check_compares_the_calls_arguments_before_the_models_values():
    """A call of another size fails at its arguments' tuple: the model's hundreds of values (a
    Hugging Face config's) are not read for a call no entry covers."""
    from tessera.trace import call_check

    class Config:
        scale = 2.0
        shift = 1.0

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cfg = Config()

        def forward(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
            return x * self.cfg.scale + extra["bias"] + self.cfg.shift

    compiled = compile_eager(Scaled())
    x, extra = torch.randn(4, 3), {"bias": torch.randn(3)}
    torch.testing.assert_close(compiled(x, extra), x * 2 + extra["bias"] + 1)
    spec = compiled.traces[0].spec
    stages = call_check._stages(spec)
    reads = [[call_check._ARGUMENTS.search(a.expr) is not None for a in stage] for stage in stages]
    assert all(len(set(stage)) == 1 for stage in reads), "each tuple reads the call or the model"
    assert reads[0][0], "the call's arguments first"
    assert any(not stage[0] for stage in reads), "the model's values are checked too"
    keyed = [i for i, stage in enumerate(stages) if any("['bias']" in a.expr for a in stage)]
    keys = [i for i, stage in enumerate(stages) if any(a.expr == "tuple(args[1])" for a in stage)]
    assert keyed and keys and min(keys) < min(keyed), "a dict's keys before its entries"
