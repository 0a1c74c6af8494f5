"""No full garbage collection while a trace or a compile runs beside the served calls.

CPython's cyclic collector runs a full collection (generation 2) once the objects that reached the
oldest generation since the last one grow by a quarter, and a full collection walks every object the
process tracks, holding the GIL. A background trace and compile grow that heap fast: importing
Dynamo and Inductor adds about 210,000 objects to the 167,000 ``import torch`` leaves, and the trace
and the compile about 150,000 more. So the collections came every second or two while they ran, each
longer than the last (120 to 300 ms on the 2-core CPU), and a request that arrived meanwhile waited
for the whole of one before its call even began: over the first minute of a stream (``python -m
benchmarks.first_minute``, docs/serving.md) the slowest call of the toy Llama (4 layers) took 38x
eager's median with full collections, 17x without, and tiny BERT's 117x and 17x. Young collections
(generations 0 and 1) walk only the objects allocated since the last one, a few milliseconds at
most.

So while any background thread runs (``hold``, taken by ``background.start_thread`` before the thread
starts, released as it ends), CPython's automatic full collections are off (the oldest generation's
threshold raised; a ``gc.collect()`` called by hand still walks everything), and when the last one
ends the heap is *frozen* (``gc.freeze``): every object then alive moves to the permanent generation
that collections never walk. The imports, the traced graphs and the compiled code of a model that
serves for the process's life live that long anyway. The costs: the cyclic garbage the window left
in the oldest generation is never collected (39,000 objects of 5 MB, their own sizes, on the toy
Llama; 84,000 of 11 MB on tiny BERT; no tensor storage in either; it grows with the compile), and
whatever was alive at the freeze is freed by reference counting only, not by the cyclic collector.
A compiled model the process drops later (a model it swaps out) goes by reference counting
(acyclic.py), and its parts' cycles by one walk of the frozen heap then (``dropped``). A young
collection first frees the garbage still young. Each window (the first trace and compile, a size
learnt later) keeps its own, once. A full collection afterwards walks only what was allocated
since. The setting is the process's: the heap is one, so a model with
``CompileConfig.freeze_heap=False`` only starts no window of its own, and every model of a process
must set it for CPython's collections to run as they are, pauses and all. vLLM freezes its heap
after start-up for the same reason.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)

_NEVER = 2**30  # the oldest generation's threshold while held: no full collection
# Bound now: CUDA graph capture (cudagraph.py) stands a no-op in for gc.collect while it captures,
# and the young collection before a freeze must be a real one.
_collect = gc.collect


def generational() -> bool:
    """Whether this interpreter's collector is the generational one this module steers: a third
    threshold that starts full collections, and a GIL. Python 3.14.0-3.14.4's incremental
    collector reads 0 there and ignores it, and a free-threaded build has one generation; there
    nothing is held, and nothing frozen."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    return bool(gil) and gc.get_threshold()[2] > 0


def _deferred(when: int | None, new: int) -> int | None:
    """Dynamo's saved threshold, swapped (``_compat.swap_deferred_gc_threshold``); imported here,
    not at the top: ``Heap`` itself needs no torch."""
    from tessera._compat import swap_deferred_gc_threshold

    return swap_deferred_gc_threshold(when, new)


class Heap:
    """Full collections held off while background threads run (one per process: ``HEAP``)."""

    def __init__(self) -> None:
        # Reentrant: the collection ``_release`` runs under it can finalize a compiled model, whose
        # ``dropped`` takes it again on the same thread (a plain lock deadlocked there: seen on
        # torch 2.15.0, a model dropped by the thread that ended the last window).
        self._lock = threading.RLock()
        self._holders = 0
        self._threshold: tuple[int, ...] | None = None  # the thresholds before the first holder
        self.freezes = 0  # the heap froze this many times
        self._collect_frozen = False  # a model dropped while held: walk everything before the freeze
        self._walking = False  # a model dropped: the frozen heap being walked
        self._releasing = False  # ``_release``'s collection is running (on the thread holding the lock)
        self._dropped_meanwhile = False  # a model it finalized owes a walk of the frozen heap

    def hold(self) -> None:
        """No automatic full collection until the matching ``release``: taken by the thread that
        starts a background thread, before it starts (so no gap between a trace that ends and the
        compile it started), and released by that thread as it ends."""
        with self._lock:
            self._holders += 1
            if self._holders == 1 and generational():
                current = gc.get_threshold()
                # A Dynamo compile running now raised it, and puts back what it saved when it ends:
                # that is held off too, and the threshold to restore is the one it saved.
                saved = _deferred(None, _NEVER)
                self._threshold = current if saved is None else (*current[:2], saved)
                gc.set_threshold(*current[:2], _NEVER)

    def release(self) -> None:
        """End a ``hold``; the last one freezes the heap and puts the threshold back."""
        with self._lock:
            self._holders -= 1
            if not self._holders:
                self._release()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """``hold`` for the body's length."""
        self.hold()
        try:
            yield
        finally:
            self.release()

    def _release(self) -> None:
        previous, self._threshold = self._threshold, None
        if previous is None:
            return  # another collector (generational() was false): nothing held
        # Off (the user's gc.disable(), or tessera's own imports on another thread): no freeze.
        if gc.isenabled():
            # The young garbage goes now (a young collection is cheap); what is in the oldest
            # generation stays, frozen. A model dropped meanwhile: the frozen heap is walked too.
            walk, self._releasing, self._dropped_meanwhile = self._collect_frozen, True, False
            try:
                if walk:
                    gc.unfreeze()
                _collect(2 if walk else 1)
                if self._dropped_meanwhile:  # that collection finalized a model it did not walk for
                    if not walk:
                        gc.unfreeze()
                    _collect()
            finally:
                self._releasing = False
            self._collect_frozen = False
            gc.freeze()  # moves the generations' lists whole: no object is visited
            self.freezes += 1
            # (No gc.get_freeze_count() here: it walks the whole frozen list, 50 ms at 530,000
            # objects, holding the GIL.)
            log.debug("heap frozen after background work")
        current = gc.get_threshold()
        if current[2:] == (_NEVER,):  # not changed meanwhile by the user
            gc.set_threshold(*current[:2], *previous[2:])
        _deferred(_NEVER, previous[2])  # a compile that began while held puts this back, not ours

    def dropped(self, freezes: int, parts: dict[str, Any]) -> None:
        """A compiled model is gone, made when the heap had frozen ``freezes`` times; ``parts`` is
        its ``__dict__``, let go of here (a dying object's dict still holds them, and would keep
        them from the collection). The model refers to nothing that refers back to it
        (acyclic.py), but its parts refer to each other, and a cycle that a freeze since reached
        is never collected: the frozen heap is then walked once (a full collection, 0.1-0.3 s on
        the 2-core CPU), now, or before the next freeze while a background thread holds
        collections off, and frozen again."""
        parts.clear()
        with self._lock:
            if self.freezes == freezes or self._walking or not gc.isenabled():
                return  # no freeze since it was made: its cycles are the collector's as usual
            if self._releasing:  # finalized by ``_release``'s collection: it walks once that ends
                self._dropped_meanwhile = True
                return
            if self._holders:
                self._collect_frozen = True
                return
            self._walking = True
        try:  # not under the lock: the collection may drop another model, which comes back here
            gc.unfreeze()
            _collect()
            gc.freeze()
            log.debug("frozen heap collected after a compiled model was dropped")
        finally:
            self._walking = False

    def after_fork(self) -> None:
        """In a forked child: the threads that held are the parent's, and will never release here.
        The child starts with nothing held, no walk in progress (a parent's thread that walked is
        not in the child), and its threshold back. A walk the parent owed (``_collect_frozen``) is
        owed here too: the dropped model's parts are in the child's frozen heap as well."""
        self._lock = threading.RLock()
        self._holders = 0
        self._walking = self._releasing = False  # a parent's thread that was releasing is not here
        previous, self._threshold = self._threshold, None
        current = gc.get_threshold()
        if previous is not None and current[2:] == (_NEVER,):
            gc.set_threshold(*current[:2], *previous[2:])


HEAP = Heap()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=HEAP.after_fork)
