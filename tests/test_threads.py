"""A compiled model shared by a server's threads: racing first calls, steady calls, a soak.

Every thread compares with eager on its own inputs; a thread that hangs fails the test (joins
have deadlines), and an exception in a thread is carried back to the test.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import tessera
from tessera.models import toy_llama

JOIN_SECONDS = 300


def run_threads(target: Callable[[int], Any], count: int) -> dict[int, Any]:
    """``target(i)`` on ``count`` threads started together; their results, or the first error."""
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def body(i: int) -> None:
        try:
            barrier.wait(timeout=JOIN_SECONDS)
            results[i] = target(i)
        except BaseException as e:  # carried back to the test
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_SECONDS)
    hung = [i for i, thread in enumerate(threads) if thread.is_alive()]
    assert not hung, f"threads {hung} did not finish in {JOIN_SECONDS}s (a deadlock?)"
    if errors:
        raise errors[0]
    return results


class State:
    """An argument object whose Python int the model reads (as a StaticCache's length)."""

    def __init__(self, n: int) -> None:
        self.n = n


def scaled(x: torch.Tensor, state: State) -> torch.Tensor:
    return torch.sin(x) * state.n + state.n


def test_two_first_calls_with_different_argument_state_both_get_eagers_numbers():
    for attempt in range(3):  # the race goes differently each time
        torch._dynamo.reset()
        compiled = tessera.compile(scaled, backend="eager", disable_cache=True)
        inputs = {i: torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)}

        def call(
            i: int, compiled: Any = compiled, inputs: dict[int, torch.Tensor] = inputs
        ) -> tuple[torch.Tensor, torch.Tensor]:
            state = State(3 + i)
            return compiled(inputs[i], state), scaled(inputs[i], state)

        for i, (got, expected) in run_threads(call, 2).items():
            torch.testing.assert_close(got, expected, msg=f"attempt {attempt}, thread {i}")


def test_eight_threads_racing_the_very_first_call_all_get_eagers_numbers():
    model = toy_llama.build(num_layers=2)
    compiled = tessera.compile(model, backend="eager", compile_sizes=[8], disable_cache=True)

    def call(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        args = toy_llama.example_inputs(3 + i, seed=i)  # sizes 3..10, 8 among them
        return compiled(*args), model(*args)

    results = run_threads(call, 8)
    assert len(results) == 8
    for i, (got, expected) in results.items():
        torch.testing.assert_close(got, expected, msg=f"thread {i}")
    assert tessera.counters.snapshot()["graphs_traced"] == 1, "one trace, whoever got there first"


class Holder(torch.nn.Module):
    """Traced by torch.fx in a thread of its own, held open half-way until released."""

    def __init__(self, inside: threading.Event, release: threading.Event) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.inside, self.release = inside, release

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inside.set()
        assert self.release.wait(JOIN_SECONDS)
        return self.inner(x)  # traced as a call of the submodule `inner`


def test_modules_called_while_another_thread_fx_traces_run_as_eager():
    # Every compile (Inductor's make_fx, its symbolic_trace of a one-line function) runs torch.fx's
    # Tracer.trace, which patches nn.Module.__call__ and __getattr__ for the whole process. A module
    # called meanwhile in a serving thread entered that trace: "NameError: module is not installed
    # as a submodule" (issue 42). tessera's first compile makes the patches act in the tracing
    # thread only; here a trace is held open half-way while this thread serves.
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager", disable_cache=True)
    args = toy_llama.example_inputs(5)
    expected = model(*args)
    torch.testing.assert_close(compiled(*args), expected)  # the first call: a trace and compiles

    inside, release, traced = threading.Event(), threading.Event(), []
    tracing = threading.Thread(
        target=lambda: traced.append(torch.fx.symbolic_trace(Holder(inside, release))), daemon=True
    )
    tracing.start()
    try:
        assert inside.wait(JOIN_SECONDS)
        for n in (5, 7):  # the eager model (nn.Module calls and attributes), then tessera's pieces
            args = toy_llama.example_inputs(n)
            torch.testing.assert_close(compiled(*args), model(*args))
        torch.testing.assert_close(model(*toy_llama.example_inputs(5)), expected)
    finally:
        release.set()
        tracing.join(JOIN_SECONDS)
    # The tracing thread still traced through its own module calls.
    assert [n.target for n in traced[0].graph.nodes if n.op == "call_module"] == ["inner"]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.inductor
def test_four_threads_of_random_sizes_on_inductor_equal_eager_and_memory_stays_flat(monkeypatch):
    # As a server runs it: the first output waits for the trace alone, pieces serve as traced
    # while their compiles (and sizes 8 and 16) run in the background, beside the threads' calls.
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="inductor", compile_sizes=[8], compile_ranges=[16])

    def calls(count: int) -> Callable[[int], int]:
        def body(i: int) -> int:
            rng = random.Random(i * 1000 + count)
            for _ in range(count):
                args = toy_llama.example_inputs(rng.randint(2, 40), seed=rng.randint(0, 99))
                got, expected = compiled(*args), model(*args)  # grad enabled, as a server's default
                torch.testing.assert_close(got, expected)
            return count

        return body

    assert sum(run_threads(calls(100), 4).values()) == 400  # warm-up: compile, first sizes
    assert compiled.wait_ready(JOIN_SECONDS), "the background compile did not finish"
    before = _resident_bytes()  # every artifact in place: what grows now is the serving
    assert sum(run_threads(calls(200), 4).values()) == 800
    grown = _resident_bytes() - before
    assert grown < 32 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over 800 calls"
    assert tessera.counters.snapshot()["graphs_traced"] == 1
