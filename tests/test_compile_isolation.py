"""A background compile shares the process with other compiles: none disturbs another.

A server runs a main and a draft model, or tessera beside the user's own ``torch.compile``: model
A's sizes compile in the background while B (stock ``torch.compile``) compiles and runs, C (another
tessera model) traces, and D (graph breaks: the guarded path) traces graph after graph.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import tessera
from tessera import _compat
from tessera.compilation.compile_state import COMPILE_LOCK
from tessera.trace.beside import Beside


def _mlp(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 16))


class _Breaks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _mlp(24), _mlp(40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x)
        torch._dynamo.graph_break()
        return self.second(y).softmax(-1)


@pytest.mark.slow
@pytest.mark.inductor
def test_a_background_compile_beside_stock_torch_compile_and_other_tessera_models():
    torch.manual_seed(0)
    # Parameters as the models make them (requiring grad), called under no_grad as a server does:
    # a background compile made with grad enabled compiled a backward graph, and that compile took
    # Dynamo's lock while a model with graph breaks held it and waited for ours (a hang).
    models = [_mlp(32), _mlp(64), _mlp(48), _Breaks()]
    background = {"backend": "inductor", "background_compile": True}
    a = tessera.compile(models[0], compile_sizes=[16, 32], compile_ranges=[8], **background)
    b = torch.compile(models[1], dynamic=True)
    c = tessera.compile(models[2], compile_sizes=[24], **background)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", tessera.TesseraWarning)  # D's graph break is said once
        d = tessera.compile(models[3], compile_sizes=[16], **background)
        for _ in range(3):
            for n in (16, 7, 33, 24, 5):
                x = torch.randn(n, 16)
                for compiled, eager in zip((a, b, c, d), models, strict=True):
                    torch.testing.assert_close(compiled(x), eager(x), msg=f"{n} rows")
    assert a.wait_ready(600) and c.wait_ready(600) and d.wait_ready(600)
    for model in (a, c):
        assert model.report is not None and model.report.background == "done", model.report.background
    with warnings.catch_warnings(), torch.no_grad():
        # Eager first: D's trace, made beside its first calls, found the break; the guarded path
        # (and its warning) may come at one of these calls.
        warnings.simplefilter("ignore", tessera.TesseraWarning)
        for n in (16, 32, 7, 24, 40):  # every size in place: still eager's numbers
            x = torch.randn(n, 16)
            for compiled, eager in zip((a, b, c, d), models, strict=True):
                torch.testing.assert_close(compiled(x), eager(x), msg=f"{n} rows, ready")


def test_the_compile_lock_is_dynamos_own():
    # One lock for every compile of the process: a lock of ours beside Dynamo's, taken in the
    # other order by a background compile, deadlocked a trace of a model with graph breaks.
    held, release = threading.Event(), threading.Event()

    def background() -> None:
        with COMPILE_LOCK:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=background)
    thread.start()
    try:
        assert held.wait(30)
        from torch._dynamo.convert_frame import compile_lock as dynamo_lock  # the lock Dynamo takes

        assert not dynamo_lock.acquire(blocking=False), "Dynamo could convert a frame mid-compile"
    finally:
        release.set()
        thread.join(30)
    assert dynamo_lock.acquire(blocking=False)
    dynamo_lock.release()


def _trace_waiting() -> bool:
    with COMPILE_LOCK._no_trace_waits:  # the count a waiting trace adds
        return COMPILE_LOCK._no_trace_waits.wait_for(lambda: COMPILE_LOCK._traces == 1, timeout=30)


def test_a_trace_waiting_for_the_lock_goes_before_the_next_background_compile():
    # A background compile releases the lock between jobs and asks again at once: Python's locks
    # are not fair, and a trace (a new shape's way out of eager serving) waited behind a model's
    # whole background compile (BERT, 20 s on the 2-core CPU).
    order: list[str] = []

    def trace() -> None:
        with COMPILE_LOCK.for_trace():
            order.append("trace")

    thread = threading.Thread(target=trace)
    with COMPILE_LOCK:  # a background compile's job
        thread.start()
        assert _trace_waiting()
    with COMPILE_LOCK.after_traces():  # its next job
        order.append("compile")
    thread.join(30)
    assert order == ["trace", "compile"]


def test_a_call_kept_while_a_trace_is_made_is_traced_before_the_first_traces_compiles():
    # The first trace's background compile asked for the lock while that trace held it, and took
    # it as the trace let it go, before the trace of the call kept meanwhile (another length)
    # asked: BERT's calls of that length were served eagerly through the 13 s of the first
    # compile job (2-core CPU), and the jobs' artifacts were thrown away when the second trace
    # widened the first.
    order: list[str] = []
    keep, compiled = threading.Event(), threading.Event()

    def compile_job() -> None:
        with COMPILE_LOCK.after_traces():
            order.append("compile")
        compiled.set()

    compiler = threading.Thread(target=compile_job)

    def tracer(args: tuple, kwargs: dict, reason: str, mismatches: list) -> None:
        with COMPILE_LOCK.for_trace():
            if not order:
                assert keep.wait(30), "the test kept no call"
                compiler.start()  # the trace starts its pieces' background compile
            order.append(f"trace of {args[0].shape[0]}")

    def uncovered(call: tuple) -> tuple[str, list]:
        # Between the traces, the lock is free: a compile let through now runs first (a bounded
        # wait, that only the fix makes run out).
        compiled.wait(1.0)
        return "another length", []

    beside = Beside("model", lambda x: x * 2, tracer)
    beside.uncovered = uncovered
    torch.testing.assert_close(beside.serve((torch.ones(2),), {}, "the first call", []), (torch.ones(2) * 2,))
    torch.testing.assert_close(beside.missed((torch.ones(3),), {}), torch.ones(3) * 2)
    keep.set()
    assert beside.landed.wait(30)
    compiler.join(30)
    assert order == ["trace of 2", "trace of 3", "compile"]


def test_a_held_back_traces_compile_waits_for_those_of_the_traces_that_serve():
    # A trace that a later one widened and holds back serves no call: its jobs left went on
    # beside the new trace's, and the pieces that serve were compiled seconds later (BERT).
    order: list[str] = []
    behind = [True]

    def held_job() -> None:
        with COMPILE_LOCK.after_traces(behind=lambda: behind[0]):
            order.append("held")

    thread = threading.Thread(target=held_job)
    COMPILE_LOCK.ahead(+1)  # a serving trace's background compile, with jobs left
    try:
        thread.start()
        thread.join(0.5)  # a bounded wait: only the ordering makes it run out
        assert thread.is_alive(), "the held-back trace's job went before the serving trace's"
        with COMPILE_LOCK.after_traces(behind=lambda: False):
            order.append("serving")
    finally:
        COMPILE_LOCK.ahead(-1)
    thread.join(30)
    assert order == ["serving", "held"]

    # Taken back (a call only it covers), it waits no more.
    order.clear()
    thread = threading.Thread(target=held_job)
    COMPILE_LOCK.ahead(+1)
    try:
        thread.start()
        behind[0] = False
        COMPILE_LOCK.changed()
        thread.join(30)
        assert order == ["held"]
    finally:
        COMPILE_LOCK.ahead(-1)


def test_a_background_compile_held_back_while_it_runs_stops_counting_as_ahead():
    # The first trace's background compile counts itself ahead when it starts; held back mid-run
    # (the next trace widened it), its own jobs would wait for that count, that is for itself.
    from types import SimpleNamespace

    from tessera.serving.schedule import Background

    background = Background(SimpleNamespace(prefix="model"), before_ready=lambda: None)
    with background._ahead_of_held():
        assert COMPILE_LOCK._ahead == 1
        background.hold_back()
        assert COMPILE_LOCK._ahead == 0, "a held-back compile still counts as ahead of itself"
        waited: list[bool] = []
        job = threading.Thread(target=lambda: waited.append(bool(COMPILE_LOCK.after_traces(lambda: True))))
        job.start()
        job.join(30)
        assert waited == [True], "the held-back compile's job waited for itself"
    assert COMPILE_LOCK._ahead == 0


def test_a_thread_holding_the_lock_does_not_wait_for_a_trace():
    # A compile under Dynamo's own call of a backend (the foreground) holds the lock: waiting
    # there for a trace that waits for the lock would never end.
    done = threading.Event()

    def trace() -> None:
        with COMPILE_LOCK.for_trace():
            pass

    def foreground() -> None:
        with COMPILE_LOCK:
            tracer.start()
            assert _trace_waiting()
            with COMPILE_LOCK.after_traces():
                done.set()

    tracer = threading.Thread(target=trace)
    thread = threading.Thread(target=foreground)
    thread.start()
    assert done.wait(30), "a compile holding the lock waited for a trace that waits for it"
    thread.join(30)
    tracer.join(30)
    assert not tracer.is_alive()


def test_a_torch_compiled_function_runs_while_another_thread_fx_traces():
    # Every compile FX-traces (AOTAutograd's make_fx). On torch 2.11-2.13 the "tracing now" flag
    # was process-wide: a torch.compile'd function called meanwhile in another thread raised.
    _compat.isolate_fx_tracing_flag()  # what a background compile does first
    inside, finish = threading.Event(), threading.Event()

    def traced(x: torch.Tensor) -> torch.Tensor:
        inside.set()
        assert finish.wait(30), "the test never let the trace finish"
        return x + 1

    errors: list[BaseException] = []

    def trace() -> None:
        try:
            torch.fx.symbolic_trace(traced)
        except BaseException as e:  # reported below
            errors.append(e)

    compiled = torch.compile(lambda x: x * 2, backend="eager")
    thread = threading.Thread(target=trace)
    thread.start()
    try:
        assert inside.wait(30)
        x = torch.randn(3)
        torch.testing.assert_close(compiled(x), x * 2)
        assert not torch.fx._symbolic_trace.is_fx_symbolic_tracing(), "this thread traces nothing"
    finally:
        finish.set()
        thread.join(30)
    assert not errors, errors
