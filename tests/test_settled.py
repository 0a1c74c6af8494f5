"""A settled process serves every model users run: calls past the trace limit, module methods and
copies, profilers and tracers, custom ops in compile workers, sliding-window decode."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tessera
from tests.child import ROOT, child_env, run_json

# tessera's defaults (tests/conftest.py sets up-front compiles and no workers for the suite).
DEFAULTS = {"TESSERA_BACKGROUND_COMPILE": "", "TESSERA_COMPILE_WORKERS": ""}


class Counting(torch.nn.Module):
    """A forward that counts its calls in a Python int and appends to a list attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(x.shape[0])
        return self.proj(x) * self.calls


def _counting_pair() -> tuple[Counting, Counting]:
    torch.manual_seed(0)
    model, reference = Counting(), Counting()
    reference.load_state_dict(model.state_dict())
    return model, reference


def test_a_forward_that_counts_is_served_past_the_trace_limit_with_one_warning():
    model, reference = _counting_pair()
    compiled = tessera.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for n in range(100):
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(n))
                torch.testing.assert_close(compiled(x), reference(x))
    assert model.calls == reference.calls == 100 and len(model.seen) == 100
    said = [w for w in caught if issubclass(w.category, tessera.TraceLimitWarning)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "calls" in str(said[0].message)  # names what changed
    assert len(compiled.traces) == tessera.CompileConfig().trace_limit


def test_max_traces_given_refuses_the_first_call_unlike_the_trace_whatever_the_timing():
    for eager_first in (False, True):
        model, _ = _counting_pair()
        compiled = tessera.compile(model, backend="eager", max_traces=1, eager_first=eager_first)
        with torch.no_grad():
            compiled(torch.randn(3, 4))
            with pytest.raises(tessera.InputMismatchError, match="max_traces=1"):
                compiled(torch.randn(3, 4))  # the count changed: no trace covers it
        assert model.calls == 1, eager_first


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_module_methods_return_the_compiled_model_and_keep_serving_compiled(backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    compiled = tessera.compile(model, backend=backend).eval()
    assert isinstance(compiled, tessera.CompiledModel)
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        changes = ((lambda c: c.to(torch.float64), torch.float64), (lambda c: c.half(), torch.half))
        for change, dtype in changes:
            changed = change(compiled)
            assert changed is compiled
            before = tessera.counters.snapshot()["backend_compilations"]
            y = x.to(dtype)
            got = compiled(y)
            assert got.dtype == dtype
            torch.testing.assert_close(got, model(y))
            # Served by a trace of its own (compiled), not by the plain module.
            assert tessera.counters.snapshot()["backend_compilations"] > before
        assert compiled.requires_grad_(False) is compiled and compiled.float() is compiled


def test_copies_and_pickles_of_a_compiled_model_compile_again():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    compiled = tessera.compile(model, backend="eager")
    x = torch.randn(3, 8)
    with torch.no_grad():
        compiled(x)
        deep = copy.deepcopy(compiled)
        assert isinstance(deep, tessera.CompiledModel) and deep.model is not model
        assert deep.compile_config == compiled.compile_config
        torch.testing.assert_close(deep(x), model(x))
        deep.model[0].weight.add_(1.0)  # the copy's weights are its own
        torch.testing.assert_close(compiled(x), model(x))
        loaded = pickle.loads(pickle.dumps(compiled))
        torch.testing.assert_close(loaded(x), model(x))
        assert copy.copy(compiled).model is model


def _profiled(cache: Path, *tool: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", *tool, str(ROOT / "tests" / "run_settled.py"), "profiled"],
        cwd=cache.parent,
        env=child_env(cache, **DEFAULTS),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    line = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{"))
    return json.loads(line)  # type: ignore[no-any-return]


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize(
    "tool",
    [("cProfile", "-o", "profile.out"), ("trace", "--count", "--missing", "-C", "coverage")],
    ids=["cProfile", "trace"],
)
def test_a_script_under_a_profiler_or_tracer_compiles_and_starts_warm(tmp_path, tool):
    cache = tmp_path / "cache"
    cold = _profiled(cache, *tool)
    assert all(cold["equal"]) and cold["ready"] is True
    counts = cold["counters"]
    assert counts["graphs_traced"] >= 1 and counts["inductor_compiles"] >= 1, counts
    assert counts["served_eagerly"] == 0, counts
    warm = _profiled(cache, *tool)
    assert all(warm["equal"]) and warm["ready"] is True
    assert warm["counters"]["graphs_traced"] == 0 and warm["counters"]["inductor_compiles"] == 0, warm


@pytest.mark.inductor
@pytest.mark.slow
def test_a_custom_op_of_the_users_script_compiles_quietly_with_workers_on(tmp_path):
    for process in ("cold", "warm"):
        proc_result = run_json("tests.run_settled", "custom_op", cache=tmp_path / "cache", **DEFAULTS)
        assert all(proc_result["equal"]) and proc_result["ready"] is True, process
        # No worker is started for a piece it could not load.
        assert proc_result["counters"]["compile_workers_started"] == 0, process
    assert proc_result["counters"]["inductor_compiles"] == 0  # warm


def test_a_custom_op_piece_is_not_sent_to_a_worker():
    from torch.fx import symbolic_trace

    from tessera import _compat

    def body(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tessera_test.gelu2(x) + 1

    import tests.run_settled  # noqa: F401  (defines tessera_test::gelu2)

    graph = symbolic_trace(body)
    traced = torch.fx.GraphModule(graph, graph.graph)
    assert _compat.ops_of_the_users(traced) == ["tessera_test::gelu2"]
    plain = symbolic_trace(lambda x: torch.relu(x) + 1)
    assert _compat.ops_of_the_users(plain) == []


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "env"),
    [
        # Compiled up front in this process: a decode traced under a window not yet full once
        # shared the pieces compiled for the trace before it, and returned an uncut cache.
        ("mistral", {"TESSERA_COMPILE_WORKERS": "0"}),
        ("qwen2", DEFAULTS),
        # A general piece's compile fixed the cache's length at a window's edge (Inductor's
        # Eq(s, 14)): a call of another length is run as traced by that piece, never handed to it.
        ("mistral", DEFAULTS),
        ("gemma3", DEFAULTS),
    ],
)
def test_sliding_window_generation_equals_eager_in_two_processes(tmp_path, family, env):
    cache = tmp_path / "cache"
    for process in ("cold", "warm"):
        result = run_json("tests.run_sliding", family, cache=cache, **env)
        assert result["equal"] == [True] * 4, (process, result["equal"])
        assert result["warned"] == [], (process, result["warned"])
    assert result["counters"]["graphs_traced"] == 0, result["counters"]


class Draws(torch.nn.Module):
    """A forward that draws random numbers (and a dropout that, in eval, draws none)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(x)) + torch.rand_like(x)


def test_the_random_calls_of_a_graph_are_found_and_an_eval_dropout_is_not_one():
    import torch.nn.functional as F

    from tessera.serving.build import random_calls

    def draws(x: torch.Tensor, training: bool) -> torch.Tensor:
        return F.dropout(x, 0.5, training) + torch.rand_like(x) + x.clone().uniform_()

    def traced(training: bool) -> torch.fx.GraphModule:
        return torch.fx.symbolic_trace(lambda x: draws(x, training))

    assert random_calls(traced(False)) == ["rand_like", "uniform_"]
    assert random_calls(traced(True)) == ["dropout", "rand_like", "uniform_"]
    assert random_calls(torch.fx.symbolic_trace(torch.nn.Linear(2, 2))) == []


@pytest.mark.inductor
@pytest.mark.parametrize("eager_stream", [False, True])
def test_random_ops_compiled_say_so_once_or_draw_eagers_stream_when_asked(tmp_path, eager_stream):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Draws().eval().requires_grad_(False)  # called with grad enabled, as users do
    settings = {"fallback_random": True} if eager_stream else {}
    compiled = tessera.compile(model, inductor_config=settings, cache_dir=str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(4, 8))
        assert compiled.wait_ready(300)
        for n in (4, 6, 9):  # a compiled size, and sizes the general artifact serves
            x = torch.randn(n, 8)
            torch.manual_seed(5)
            ours, after = compiled(x), torch.rand(3)
            torch.manual_seed(5)
            eagers, eager_after = model(x), torch.rand(3)
            assert torch.equal(ours, eagers) is eager_stream, n
            assert torch.equal(after, eager_after) is eager_stream, n
    said = [w for w in caught if "draws random numbers" in str(w.message)]
    assert len(said) == (0 if eager_stream else 1), [str(w.message) for w in said]
    assert all("fallback_random" in str(w.message) for w in said)
