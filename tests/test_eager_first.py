"""Eager first: with background compile on, a call no trace covers is answered by the model's own
forward while its trace is made in another thread (beside.py). Not the default: turned on here."""

from __future__ import annotations

import logging
import threading
from contextlib import nullcontext

import pytest
import torch

import tessera
from tessera import _compat, counters
from tessera.api import Stage
from tests.child import run_json


@pytest.fixture(autouse=True)
def _background_on(monkeypatch):
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    monkeypatch.setenv("TESSERA_EAGER_FIRST", "1")


class Counting(torch.nn.Module):
    """Writes its own state on every call: a buffer in place, and a Python int."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.steps += 1
        return torch.relu(self.lin(x)) * 2


def eagerly() -> int:
    return counters.snapshot()["served_eagerly"]


def expected(model: Counting, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.relu(model.lin(x)) * 2


def test_the_first_call_is_served_eagerly_and_the_state_is_written_once_per_call():
    model = Counting().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager")
    x = torch.randn(3, 8)
    with counters.expect(served_eagerly=1):
        torch.testing.assert_close(compiled(x), expected(model, x))
    assert compiled.stage in (Stage.EAGER, Stage.READY)
    assert compiled.wait_ready(60)
    assert compiled.stage is Stage.READY and len(compiled.traces) == 1
    for n in (3, 5, 17):  # sizes it was not made for included (``steps`` changes: traced again)
        x = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x), expected(model, x))
    assert compiled.wait_ready(60)
    # The trace did not run the forward a second time: four calls, four writes.
    assert int(model.calls) == 4 and model.steps == 4
    assert compiled.report is not None and compiled.report.kind == "cold"
    # The report's picture shows the eager phase on the timeline, before the trace.
    spans = compiled.report.as_dict()["timeline"]
    assert spans[0]["what"].startswith("served eagerly") and spans[1]["what"] == "trace 1"


def test_the_trace_sees_the_first_call_as_it_was_not_as_the_caller_changed_it_after():
    def model(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(xs).sum(0) * 3

    compiled = tessera.compile(model, backend="eager")
    xs = [torch.randn(4), torch.randn(4)]
    torch.testing.assert_close(compiled(xs), model(xs))
    xs.append(torch.randn(4))  # the caller reuses its list; the trace was of two tensors
    xs[0].mul_(10)
    assert compiled.wait_ready(60)
    assert len(compiled.traces) == 1
    two = [torch.randn(4), torch.randn(4)]
    with counters.expect(served_eagerly=0):  # the trace was of two tensors: it serves this
        torch.testing.assert_close(compiled(two), model(two))
    with counters.expect(served_eagerly=1):  # three: no trace covers it yet
        torch.testing.assert_close(compiled(xs), model(xs))


# What a cold first call must not wait for: the traces, the compile, the cache's entries and the
# report, each imported (about 70 ms on a 2-core CPU) by the trace thread after eager answered.
MACHINERY = (
    "tessera.trace.traces",
    "tessera.serving.split_model",
    "tessera.report",
    "tessera.compilation.inductor_compiler",
    "tessera.cache.entry",
)


def test_a_cold_first_call_answers_before_the_machinery_is_imported_and_a_warm_one_loads(tmp_path):
    cache = tmp_path / "cache"
    cold = run_json("tests.run_cold_first", "eager", cache=cache, TESSERA_BACKGROUND_COMPILE="1")
    assert cold["stage_after_first"] == "eager"
    imported = cold["modules_when_the_trace_started"]
    assert imported and not [m for m in MACHINERY if m in imported], imported
    assert cold["traces"] == 1 and cold["warm_start"] is False
    # The next process finds the trace saved: its first call is served by it, not eagerly.
    warm = run_json("tests.run_cold_first", "eager", cache=cache, TESSERA_BACKGROUND_COMPILE="1")
    assert warm["stage_after_first"] == "ready" and warm["warm_start"] is True
    assert warm["counters"]["served_eagerly"] == 0 and warm["counters"]["graphs_traced"] == 0


def test_calls_while_the_trace_is_made_are_served_eagerly_and_a_later_miss_is_traced_beside():
    model = Counting().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager")
    xs = [torch.randn(n, 8) for n in (2, 3, 4, 5, 6)]
    for x in xs:  # some of these are served eagerly, some by the trace once it serves
        torch.testing.assert_close(compiled(x), expected(model, x))
    assert compiled.wait_ready(60)
    before = eagerly()
    x = torch.randn(2, 3, 8)  # another rank: no trace covers it, eager serves it
    torch.testing.assert_close(compiled(x), expected(model, x))
    assert eagerly() == before + 1
    assert compiled.wait_ready(60)
    assert len(compiled.traces) == 2, "the miss was traced beside eager"
    with counters.expect(served_eagerly=0):
        torch.testing.assert_close(compiled(x), expected(model, x))
    assert int(model.calls) == model.steps == 7


def test_a_call_that_finds_a_trace_its_thread_has_not_installed_runs_it_and_leaves_the_install():
    # The trace thread, paced, waits at its next Python call while a call is served: a call that
    # finds the new entry before that thread installs it must not build the check and report the
    # first trace itself (its latency), only run the entry (traces.py, ``_fresh``).
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).requires_grad_(False)
    compiled = tessera.compile(model, backend="eager")
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), model(x))
    assert compiled.wait_ready(60)
    traces = compiled._traces
    assert traces is not None and traces.last is not None
    entry, installed = traces.last, []
    traces._install = installed.append
    traces.last = None  # as just made, not yet installed
    other = threading.Thread(target=lambda: None)
    other.start()
    other.join()
    traces._fresh = (entry, other.ident)  # made by another thread, which installs it
    try:
        traces._serving(entry)  # a served call that found it
        assert installed == [] and traces.last is None
        torch.testing.assert_close(compiled(torch.randn(5, 8)).shape, torch.Size([5, 8]))
    finally:
        traces._fresh = None
    traces._serving(entry)  # by the thread that made it (or with no entry in the making)
    assert installed == [entry] and traces.last is entry


def test_grad_enabled_calls_are_served_under_the_grad_policy_while_eager():
    model = Counting()  # parameters require grad, as made
    compiled = tessera.compile(model, backend="eager")
    with pytest.raises(tessera.GradientsNotSupportedError):
        compiled(torch.randn(2, 8))
    frozen = Counting().requires_grad_(False)
    compiled = tessera.compile(frozen, backend="eager")
    out = compiled(torch.randn(2, 8))  # grad enabled, nothing requires grad: inference
    assert not out.requires_grad and out.grad_fn is None
    assert compiled.wait_ready(60)


def test_a_model_whose_trace_fails_keeps_serving_eagerly_with_one_warning(monkeypatch, caplog):
    from tessera.trace import traces

    def refuse(*args, **kwargs):
        raise tessera.UnsupportedArgumentError("tessera cannot take argument 'x' (a test)")

    monkeypatch.setattr(traces, "trace_once", refuse)
    model = Counting().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="tessera.api"):
        for n in (2, 3, 4):
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), expected(model, x))
            assert compiled.wait_ready(60)
    said = [r for r in caplog.records if "served eagerly" in r.getMessage()]
    assert len(said) == 1 and "cannot take argument" in said[0].getMessage()
    assert compiled.stage is Stage.EAGER and eagerly() == 3


def test_a_model_with_graph_breaks_takes_the_guarded_path_after_its_eager_first_call():
    def model(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos() + 1

    compiled = tessera.compile(model, backend="eager")
    x = torch.randn(4)
    with counters.expect(served_eagerly=1):
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.wait_ready(60)
    for n in (4, 6):
        x = torch.randn(n)
        with pytest.warns(tessera.TesseraWarning, match="graph breaks") if n == 4 else nullcontext():
            torch.testing.assert_close(compiled(x), model(x))
    assert compiled.stage is Stage.READY and compiled.traces == ()


def test_a_cold_first_call_whose_traces_cannot_be_made_raises_at_the_next_call(monkeypatch):
    # What the traces need (the cache's and the fleet's settings) is read by the trace thread of a
    # cold first call: an error there reaches the caller at the next call, not eager forever.
    from tessera.api import CompiledModel
    from tessera.errors import ConfigError

    made = CompiledModel._make_traces

    def failing(self):
        raise ConfigError("a setting the traces need is wrong")

    monkeypatch.setattr(CompiledModel, "_make_traces", failing)
    model = Counting().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager")
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), expected(model, x))  # eager answered
    assert compiled.wait_traced(60)
    with pytest.raises(ConfigError, match="a setting the traces need"):
        compiled(x)
    monkeypatch.setattr(CompiledModel, "_make_traces", made)  # the user fixes it: traced now
    torch.testing.assert_close(compiled(x), expected(model, x))
    assert compiled.wait_ready(60)
    assert len(compiled.traces) == 1 and compiled.stage is Stage.READY


def test_a_trace_saved_by_another_process_after_the_first_call_looked_serves_it(monkeypatch, tmp_path):
    # The cache was empty when the first call looked (served eagerly, nothing imported); another
    # process saved the model's trace before the trace thread read it: that trace is taken.
    x = torch.randn(3, 8)
    torch.manual_seed(0)
    other = tessera.compile(Counting().requires_grad_(False), backend="eager", cache_dir=str(tmp_path))
    other(x)
    assert other.wait_ready(60) and len(other.traces) == 1
    torch._dynamo.reset()
    monkeypatch.setattr("tessera.api.nothing_saved", lambda config: True)
    torch.manual_seed(0)
    model = Counting().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager", cache_dir=str(tmp_path))
    with counters.expect(served_eagerly=1, graphs_traced=0):
        torch.testing.assert_close(compiled(x), expected(model, x))
        assert compiled.wait_ready(60)
    assert compiled.warm_start is True and [e.loaded for e in compiled.traces] == [True]
    with counters.expect(served_eagerly=0):
        torch.testing.assert_close(compiled(x), expected(model, x))


def test_background_compile_false_traces_on_the_first_call():
    model = Counting().requires_grad_(False)
    x = torch.randn(3, 8)
    compiled = tessera.compile(model, backend="eager", background_compile=False)
    torch.testing.assert_close(compiled(x), expected(model, x))
    assert eagerly() == 0
    assert compiled.stage is Stage.READY and len(compiled.traces) == 1


def test_is_compiling_answers_for_the_compiling_thread_only():
    _compat.isolate_compiling_flag()
    if not hasattr(torch.compiler, "_compile_session_context"):
        pytest.skip("this torch has no process-wide compile session flag")
    inside = threading.Event()
    leave = threading.Event()
    seen: list[bool] = []

    def compile_session() -> None:
        with torch.compiler._compile_session_context():
            seen.append(torch.compiler.is_compiling())
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=compile_session)
    thread.start()
    try:
        assert inside.wait(30)
        assert torch.compiler.is_compiling() is False  # this thread compiles nothing
    finally:
        leave.set()
        thread.join()
    assert seen == [True]


class Flag(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: bool = True) -> torch.Tensor:
        return x * 2 if scale else x + 1


def test_calls_missed_while_a_trace_is_made_are_traced_after_it_and_saved(monkeypatch, tmp_path):
    from tessera.trace import traces

    gate = threading.Event()
    original = traces.trace_once

    def held(*args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return original(*args, **kwargs)

    monkeypatch.setattr(traces, "trace_once", held)
    x = torch.randn(4, 3)
    compiled = tessera.compile(Flag(), backend="eager", cache_dir=str(tmp_path))
    with counters.expect(served_eagerly=3):
        torch.testing.assert_close(compiled(x), x * 2)  # traced beside, held at the gate
        torch.testing.assert_close(compiled(x, False), x + 1)  # missed: kept, served eagerly
        torch.testing.assert_close(compiled(x * 3, False), x * 3 + 1)  # kept too
    assert compiled.stage is Stage.EAGER
    gate.set()
    assert compiled.wait_ready(60)
    assert compiled.traces[0].reason == "the first call"
    assert len(compiled.traces) == 2, "the second kept call was covered by the trace of the first"
    with counters.expect(served_eagerly=0):
        torch.testing.assert_close(compiled(x, False), x + 1)
        torch.testing.assert_close(compiled(x), x * 2)
    # Both traces reached the cache: a new process's model loads them and traces nothing.
    monkeypatch.setattr(traces, "trace_once", original)
    torch._dynamo.reset()
    warm = tessera.compile(Flag(), backend="eager", cache_dir=str(tmp_path))
    with counters.expect(served_eagerly=0, graphs_traced=0):
        torch.testing.assert_close(warm(x, False), x + 1)
        torch.testing.assert_close(warm(x), x * 2)
    assert [e.loaded for e in warm.traces] == [True, True]


def test_a_call_found_uncovered_while_a_trace_is_made_is_served_eagerly_without_the_search(monkeypatch):
    """Calls like one no entry covered go to eager at once while the trace is in flight; a call
    an entry covers is still served by it, and once the trace lands it serves the rest."""
    from tessera.trace import traces

    gate, original = threading.Event(), traces.trace_once
    searches: list[int] = []
    covering = traces.covering

    def held(*args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return original(*args, **kwargs)

    def counted(*args, **kwargs):
        searches.append(1)
        return covering(*args, **kwargs)

    compiled = tessera.compile(Flag(), backend="eager", disable_cache=True)
    x = torch.randn(4, 3)
    torch.testing.assert_close(compiled(x), x * 2)
    assert compiled.wait_traced(60)
    monkeypatch.setattr(traces, "trace_once", held)
    monkeypatch.setattr(traces, "covering", counted)
    with counters.expect(served_eagerly=1):
        torch.testing.assert_close(compiled(x, False), x + 1)  # uncovered: traced beside, held
    searches.clear()
    y = torch.randn(4, 3)
    with counters.expect(served_eagerly=3):
        for _ in range(3):
            torch.testing.assert_close(compiled(y, False), y + 1)  # like it: no search
    assert searches == [1], "only the first call of the kind searched the entries"
    with counters.expect(served_eagerly=0):
        torch.testing.assert_close(compiled(y), y * 2)  # covered by the first trace
        torch.testing.assert_close(compiled(y, scale=True), y * 2)  # another syntax, covered
    with counters.expect(served_eagerly=1):
        torch.testing.assert_close(compiled(torch.ones(4, 3), False), torch.full((4, 3), 2.0))
    gate.set()
    assert compiled.wait_traced(60)
    with counters.expect(served_eagerly=0):
        torch.testing.assert_close(compiled(y, False), y + 1)  # the new trace serves it
    assert len(compiled.traces) == 2


def test_threads_calling_a_cold_model_at_once_get_eager_outputs_and_one_trace():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).requires_grad_(False)
    compiled = tessera.compile(model, backend="eager")
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def serve(seed: int) -> None:
        try:
            start.wait(30)
            for n in range(2, 30):
                x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed * 100 + n))
                torch.testing.assert_close(compiled(x), model(x))
        except BaseException as e:  # raised by the main thread
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert compiled.wait_ready(60)
    assert len(compiled.traces) == 1 and counters.snapshot()["graphs_traced"] == 1


def test_a_first_call_eager_rejects_raises_eagers_error_and_leaves_no_trace_behind():
    model = Counting().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        compiled(torch.randn(3, 5))  # eager's own error, the caller's
    assert compiled.wait_traced(30) and compiled.traces == ()
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), expected(model, x))
    assert compiled.wait_ready(60) and len(compiled.traces) == 1


def test_the_bytes_a_kept_call_would_copy_are_counted_through_containers_and_objects():
    from tessera.trace.beside import tensor_bytes

    class Cache:  # as a Hugging Face cache holds its layers
        def __init__(self) -> None:
            self.layers = [{"keys": torch.zeros(4, 8), "values": torch.zeros(4, 8)}]

    assert tensor_bytes(((torch.zeros(10, dtype=torch.float16),), {"cache": Cache()})) == 20 + 2 * 128
    assert tensor_bytes(torch.nn.Linear(100, 100)) == 0  # the model's weights are not the call's


@pytest.mark.inductor
def test_inductor_eager_first_in_two_fresh_processes_the_second_traces_and_compiles_nothing(tmp_path):
    from tests.child import run_toy

    cache = tmp_path / "child-cache"
    env = {"TESSERA_BACKGROUND_COMPILE": "1", "TESSERA_EAGER_FIRST": "1"}
    # The cold process answers eagerly and exits at once: its exit waits for the trace made beside
    # eager and its compiles, so the cache gets everything.
    cold = run_toy(cache, tmp_path / "cold.pt", "--sizes", "5,16", **env)
    assert cold["counters"]["served_eagerly"] >= 1 and cold["warm_start"] is not True
    warm = run_toy(cache, tmp_path / "warm.pt", "--sizes", "5,16,23", **env)
    counts = warm["counters"]
    assert warm["warm_start"] is True, warm
    assert counts.get("served_eagerly", 0) == 0 and counts.get("graphs_traced", 0) == 0, counts
    assert counts.get("inductor_compiles", 0) == 0, counts
