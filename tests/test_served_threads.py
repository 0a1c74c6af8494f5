"""A call served as traced while compiles run beside it leaves them a core (served_threads.py):
its thread's OpenMP count is one fewer per compile, put back after, and nothing else changes."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import pytest
import torch

import tessera
from tessera import _compat, served_threads
from tessera.models import toy_llama
from tessera.pacing import PACER
from tests.custom_compiler import BlockingCompiler
from tests.threads import in_thread, stream_until_ready

BLOCKING = "tests.custom_compiler:BlockingCompiler"

pytestmark = pytest.mark.skipif(
    _compat.openmp_runtime() is None, reason="this torch has no OpenMP runtime (another parallel backend)"
)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_runtime_set_is_the_one_torch_ships_when_it_ships_one():
    package = os.path.dirname(os.path.dirname(torch.__file__))
    shipped = [
        name
        for folder in (os.path.join(package, "torch", "lib"), os.path.join(package, "torch.libs"))
        if os.path.isdir(folder)
        for name in os.listdir(folder)
        if name.startswith(("libgomp", "libomp", "libiomp5"))
    ]
    if not shipped:
        pytest.skip("this torch uses a system OpenMP runtime")
    runtime = _compat.openmp_runtime()
    assert runtime is not None and runtime.path.startswith(os.path.join(package, "torch")), runtime


def test_a_thread_that_leaves_cores_runs_on_fewer_and_no_other_thread_does(two_threads):
    inside, started, done = [], threading.Event(), threading.Event()

    def other() -> None:  # a thread already running: its count is its own
        started.set()
        done.wait(30)
        inside.append(torch.get_num_threads())

    neighbour = threading.Thread(target=other)
    neighbour.start()
    started.wait(30)
    full = served_threads.leave_cores(1)
    try:
        assert full == 2 and torch.get_num_threads() == 1
        # A thread started now, and one that was running, keep the process's count: Inductor's
        # code generation in a compile thread reads it.
        assert in_thread(torch.get_num_threads) == 2
        done.set()
        neighbour.join()
        assert inside == [2]
        x = torch.randn(64, 64)
        torch.testing.assert_close(x @ x, (x.double() @ x.double()).float(), rtol=1e-4, atol=1e-4)
    finally:
        served_threads.put_back(full)
    assert torch.get_num_threads() == 2
    # Never below one thread; nothing to change on one thread already.
    full = served_threads.leave_cores(5)
    assert full == 2 and torch.get_num_threads() == 1
    assert served_threads.leave_cores(1) is None
    served_threads.put_back(full)
    assert torch.get_num_threads() == 2


def test_calls_served_beside_a_compile_leave_it_a_core_and_eager_calls_keep_theirs(two_threads):
    with PACER.serving():
        assert torch.get_num_threads() == 2  # no compile running
    with PACER.compiling():
        with PACER.serving():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with PACER.serving(eagerly=True):
            assert torch.get_num_threads() == 2
    assert PACER.compiles == 0


@pytest.mark.parametrize("priority", ["low", "normal"])
def test_a_model_serves_on_fewer_threads_while_its_compile_runs_and_on_all_once_ready(
    monkeypatch, two_threads, priority
):
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    BlockingCompiler.release = threading.Event()
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend=BLOCKING, background_priority=priority)
    seen: list[int] = []  # each served call's thread count
    recording = [False]

    def record(module, args):
        if recording[0]:
            seen.append(torch.get_num_threads())

    # The root's hooks run inside the served call (tessera runs them itself): they see its count.
    model.register_forward_pre_hook(record)

    def call(n: int) -> None:
        args = toy_llama.example_inputs(n)
        recording[0] = True
        try:
            got = compiled(*args)
        finally:
            recording[0] = False
        torch.testing.assert_close(got, model(*args), msg=f"{n} tokens, stage {compiled.stage.value}")

    try:
        call(5)  # served eagerly while the trace is made beside it
        assert compiled.wait_traced(60)
        for n in (7, 9):  # served as traced while the compile waits
            call(n)
        assert not compiled.ready
    finally:
        BlockingCompiler.release.set()
    assert compiled.wait_ready(60)
    call(10)
    fewer = 1 if priority == "low" else 2  # at "normal" nothing gives way on the cores
    assert seen == [2, fewer, fewer, 2]  # eager, as traced beside the compile, compiled
    assert PACER.compiles == 0


@pytest.mark.inductor
def test_inductor_calls_served_beside_the_compile_leave_it_a_core_and_equal_eager(monkeypatch, two_threads):
    # The defaults: Inductor, background compile, eager first; calls keep coming while it compiles.
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, compile_sizes=[8])
    seen: list[int] = []
    recording = [False]
    model.register_forward_pre_hook(
        lambda module, args: seen.append(torch.get_num_threads()) if recording[0] else None
    )

    @contextlib.contextmanager
    def recorded() -> Iterator[None]:  # the model's own calls (the reference) are not recorded
        recording[0] = True
        try:
            yield
        finally:
            recording[0] = False

    stream_until_ready(compiled, model, during=recorded)
    # The first call was served eagerly on both threads; some were served as traced or compiled
    # beside the compile, on one; none after.
    assert seen[0] == 2 and 1 in seen, seen
    recording[0] = True
    for n in (5, 8, 13):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, ready")
    assert seen[-3:] == [2, 2, 2]
