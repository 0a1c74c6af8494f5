"""No full garbage collection while a background trace or compile runs, and the heap frozen when
the last one ends (heap.py): the pauses a request would wait for are gone, nothing else changes."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator

import pytest
import torch

import tessera
from tessera.background import start_thread
from tessera.heap import HEAP, Heap, generational
from tessera.models import toy_llama
from tests.custom_compiler import BlockingCompiler
from tests.threads import stream_until_ready

BLOCKING = "tests.custom_compiler:BlockingCompiler"

pytestmark = pytest.mark.skipif(
    not generational(), reason="a collector without generations (free-threaded, Python 3.14.0-3.14.4)"
)


class Node:
    """A weak-referenceable object that can sit in a cycle."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _nothing_held() -> Iterator[None]:
    """No background thread of an earlier test holds the heap, and the thresholds come back."""
    _join_background()
    assert HEAP._holders == 0
    threshold = gc.get_threshold()
    yield
    gc.enable()
    gc.set_threshold(*threshold)


@pytest.fixture
def full_collections() -> Iterator[list[bool]]:
    """The generation-2 collections CPython runs meanwhile: for each, whether the heap was held."""
    seen: list[bool] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            seen.append(HEAP._holders > 0)

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


def _grow_old_generation() -> list[list[int]]:
    """Enough objects that survive young collections to make CPython run a full collection (once
    those that reached the oldest generation grow by a quarter of it)."""
    return [[i] for i in range(len(gc.get_objects()) // 2)]


def _join_background() -> None:
    """Wait for tessera's background threads (a model is ready just before its thread ends): the
    ones ``background.start_thread`` started, not daemons (a compile pool's workers live as long as
    the process, and waiting on each would cost a minute per test)."""
    for thread in threading.enumerate():
        if thread.name.startswith("tessera-") and not thread.daemon:
            thread.join(60)
            assert not thread.is_alive(), f"{thread.name} still runs after a minute"


def test_no_full_collection_while_held_and_young_garbage_collected_before_the_freeze(full_collections):
    before_threshold, before_frozen = gc.get_threshold(), gc.get_freeze_count()
    kept = _grow_old_generation()  # the control: unheld, the same growth runs full collections
    assert full_collections, "CPython ran no full collection: the test cannot tell a held heap"
    full_collections.clear()
    with HEAP.held():
        assert gc.get_threshold()[:2] == before_threshold[:2]
        kept += _grow_old_generation()
        young = weakref.ref(Node())  # cyclic garbage, still in the youngest generation
    assert not full_collections  # neither while held nor for the freeze
    assert young() is None  # collected before the freeze, not kept with the heap
    assert gc.get_threshold() == before_threshold
    assert gc.get_freeze_count() >= before_frozen + len(kept)
    gc.unfreeze()


def test_the_heap_is_frozen_when_the_last_holder_ends_only():
    heap, frozen = Heap(), gc.get_freeze_count()
    heap.hold()
    heap.hold()
    try:
        heap.release()
        assert gc.get_freeze_count() == frozen and gc.get_threshold()[2] > 10**6
    finally:
        heap.release()
    assert gc.get_freeze_count() > frozen and gc.get_threshold()[2] < 10**6
    gc.unfreeze()


def test_thresholds_the_user_set_meanwhile_are_theirs_and_a_disabled_collector_is_not_frozen():
    before = gc.get_threshold()
    with HEAP.held():
        gc.set_threshold(500, 5, gc.get_threshold()[2])  # the young thresholds only
    assert gc.get_threshold() == (500, 5, before[2])
    with HEAP.held():
        gc.set_threshold(500, 5, 5)
    assert gc.get_threshold() == (500, 5, 5)
    gc.set_threshold(*before)
    frozen = gc.get_freeze_count()
    gc.disable()
    with HEAP.held():
        kept = [[i] for i in range(1000)]  # tracked, alive at the end: a freeze would take them
    assert gc.get_freeze_count() == frozen  # the user collects by hand: nothing to freeze for
    assert gc.get_threshold() == before and len(kept) == 1000


@contextlib.contextmanager
def _dynamo_compiling(monkeypatch) -> Iterator[None]:
    """A Dynamo compile's window on full collections: torch's own (2.15 on), else its behaviour
    (the oldest generation's threshold raised to at least 1000, the saved one put back at the end)."""
    from torch._dynamo import utils

    if hasattr(utils, "deferred_full_gc"):
        with utils.deferred_full_gc():
            yield
        return
    monkeypatch.setattr(utils, "_gc_threshold_lock", threading.Lock(), raising=False)
    monkeypatch.setattr(utils, "_gc_threshold_saved", gc.get_threshold(), raising=False)
    gc.set_threshold(*gc.get_threshold()[:2], max(gc.get_threshold()[2], 1000))
    yield
    gc.set_threshold(*utils._gc_threshold_saved)
    utils._gc_threshold_saved = None


def test_a_dynamo_compile_across_either_end_of_the_window_leaves_the_threshold_as_it_was(monkeypatch):
    before = gc.get_threshold()
    held = Heap()
    # Begun inside the window, ended after it: Dynamo saved the raised threshold, and (before)
    # put it back for good: no full collection ever again.
    held.hold()
    with _dynamo_compiling(monkeypatch):
        held.release()
        assert gc.get_threshold() == before  # collections resume, though the compile still runs
    assert gc.get_threshold() == before
    # Begun before the window, ended inside it: still held until the window ends.
    with _dynamo_compiling(monkeypatch):
        held.hold()
    try:
        assert gc.get_threshold()[2] > 10**6
    finally:
        held.release()
    assert gc.get_threshold() == before
    gc.unfreeze()


def test_a_forked_child_starts_with_nothing_held_and_owes_the_walk_its_parent_owed():
    HEAP.hold()
    HEAP._walking = HEAP._collect_frozen = True  # a parent's thread walking; a drop while held
    try:
        pid = os.fork()
        if pid == 0:  # the child: the holding thread is the parent's, and so is the walk
            clear = HEAP._holders == 0 and not HEAP._walking and HEAP._collect_frozen
            os._exit(0 if clear and gc.get_threshold()[2] < 10**6 else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        HEAP._walking = HEAP._collect_frozen = False
        HEAP.release()
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("freeze_heap", [True, False])
def test_a_background_thread_holds_full_collections_off_unless_freeze_heap_is_off(freeze_heap):
    seen = []
    thread = start_thread(
        "tessera-test", lambda: seen.append(gc.get_threshold()[2]), priority="normal", freeze_heap=freeze_heap
    )
    thread.join()
    assert (seen[0] > 10**6) is freeze_heap
    assert gc.get_threshold()[2] < 10**6


@pytest.mark.parametrize("freeze_heap", [True, False])
def test_a_model_holds_full_collections_off_while_it_traces_and_compiles(monkeypatch, freeze_heap):
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    BlockingCompiler.release = threading.Event()
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend=BLOCKING, freeze_heap=freeze_heap)
    frozen = gc.get_freeze_count()
    try:
        for n in (5, 7):  # eagerly while the trace is made, then as traced while the compile waits
            args = toy_llama.example_inputs(n)
            torch.testing.assert_close(compiled(*args), model(*args))
            assert compiled.wait_traced(60)
        assert (gc.get_threshold()[2] > 10**6) is freeze_heap
    finally:
        BlockingCompiler.release.set()
    assert compiled.wait_ready(60)
    _join_background()
    assert gc.get_threshold()[2] < 10**6
    assert (gc.get_freeze_count() > frozen) is freeze_heap
    args = toy_llama.example_inputs(9)
    torch.testing.assert_close(compiled(*args), model(*args))


def _served_until_ready(model: torch.nn.Module, **config: object) -> tessera.CompiledModel:
    compiled = tessera.compile(model, **config)
    stream_until_ready(compiled, model)
    _join_background()
    return compiled


def _alive(refs: dict[str, weakref.ref]) -> list[str]:
    """Which of ``refs`` live on, the collector off while they are read."""
    gc.disable()  # enabled again by _nothing_held
    return [name for name, ref in refs.items() if ref() is not None]


def test_a_dropped_model_goes_with_its_last_reference_though_the_background_froze_the_heap(monkeypatch):
    # Eager first ends its trace before the frame runs, from Dynamo's guard filter: the guard
    # builder and the compile's callback kept what the trace reached (_compat.guard_build_abandoned);
    # the model's parts refer to each other, and the freeze reached those cycles (heap.dropped).
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    model = toy_llama.build(num_layers=1)
    compiled = _served_until_ready(model, backend="eager")
    assert HEAP.freezes > 0
    refs = {"the model": weakref.ref(model), "the compiled model": weakref.ref(compiled)}
    del model, compiled
    assert _alive(refs) == []


def test_a_model_dropped_while_another_compiles_goes_when_the_heap_freezes_again(monkeypatch):
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    first = toy_llama.build(num_layers=1)
    served = _served_until_ready(first, backend="eager")
    refs = {"the model": weakref.ref(first), "the compiled model": weakref.ref(served)}
    BlockingCompiler.release = threading.Event()
    second = toy_llama.build(num_layers=1)
    compiled = tessera.compile(second, backend=BLOCKING)
    try:
        for n in (5, 7):  # eagerly while the trace is made, then as traced while the compile waits
            torch.testing.assert_close(
                compiled(*toy_llama.example_inputs(n)), second(*toy_llama.example_inputs(n))
            )
            assert compiled.wait_traced(60)
        del first, served  # while the compile holds collections off: the heap is walked at its end
        assert _alive(refs) == ["the model"]
        gc.enable()
    finally:
        BlockingCompiler.release.set()
    assert compiled.wait_ready(60)
    _join_background()
    assert _alive(refs) == []


def test_freeze_heap_reads_the_environment_and_is_checked(monkeypatch):
    monkeypatch.setenv("TESSERA_FREEZE_HEAP", "0")
    assert tessera.CompileConfig().freeze_heap is False
    monkeypatch.delenv("TESSERA_FREEZE_HEAP")
    assert tessera.CompileConfig().freeze_heap is True
    with pytest.raises(tessera.ConfigError, match="freeze_heap"):
        tessera.CompileConfig(freeze_heap="yes")  # type: ignore[arg-type]


@pytest.mark.inductor
def test_inductor_defaults_run_no_full_collection_while_compiling_and_equal_eager(
    monkeypatch, full_collections
):
    # The defaults: Inductor, background compile, eager first; calls keep coming while it compiles,
    # and the trace and the compile allocate enough to run several full collections unheld.
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, compile_sizes=[8])
    frozen = gc.get_freeze_count()
    stream_until_ready(compiled, model)
    _join_background()
    assert True not in full_collections  # none while the trace or the compile held the heap
    for n in (5, 8, 13):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, ready")
    assert gc.get_freeze_count() > frozen
    refs = {"the model": weakref.ref(model), "the compiled model": weakref.ref(compiled)}
    del model, compiled
    assert _alive(refs) == []


def test_a_model_finalized_by_the_collection_at_the_freeze_does_not_deadlock_and_is_walked_for():
    # The last holder's release collects under the heap's lock; a compiled model in that garbage is
    # finalized there, on the same thread, and its drop takes the lock again. In a child: a
    # deadlock there would hang this process's heap.
    script = """if True:
        import gc, weakref
        from tessera import heap
        walks = []
        collect = heap._collect
        heap._collect = lambda *a: walks.append(a) or collect(*a)
        HEAP = heap.HEAP
        HEAP.hold()
        HEAP.release()  # one freeze: a model made before it owes a walk when dropped
        HEAP.hold()
        class Model:
            pass
        model = Model()
        model.cycle = model  # garbage only a collection finds
        weakref.finalize(model, HEAP.dropped, 0, {})
        del model
        HEAP.release()
        print(walks, HEAP.freezes, gc.get_threshold()[2])
    """
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    walks, freezes, threshold = done.stdout.rsplit(" ", 2)
    # The young collection at the freeze finalized it; then one walk of the whole heap (a full
    # collection, no generation), and the threshold put back.
    assert walks == "[(1,), (1,), ()]" and freezes == "2" and int(threshold) < 2**30, done.stdout
