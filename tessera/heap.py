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

So while any background thread ``held`` runs, full collections are off (the oldest generation's
threshold raised), and when the last one ends the heap is *frozen* (``gc.freeze``): every object
then alive moves to the permanent generation that collections never walk. The imports, the traced
graphs and the compiled code live for the process anyway; the cost is the cyclic garbage the window
left in the oldest generation, which is never collected: 39,000 objects of 5 MB (their own sizes) on
the toy Llama, 84,000 of 11 MB on tiny BERT, no tensor storage in either (a young collection first
frees the garbage still young). Each window (the first trace and compile, a size learnt later) keeps
its own, once. A full collection afterwards walks only what was allocated since.
``CompileConfig.freeze_heap=False`` keeps CPython's collections as they are, pauses and all. vLLM
freezes its heap after start-up for the same reason.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

_NEVER = 2**30  # the oldest generation's threshold while held: no full collection


class Heap:
    """Full collections held off while background threads run (one per process: ``HEAP``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._threshold: tuple[int, ...] | None = None  # the thresholds before the first holder

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No full collection while the body runs (in a background thread); the heap frozen when
        the last holder ends."""
        with self._lock:
            self._holders += 1
            if self._holders == 1:
                self._threshold = gc.get_threshold()
                gc.set_threshold(*self._threshold[:2], _NEVER)
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if not self._holders:
                    self._release()

    def _release(self) -> None:
        previous, self._threshold = self._threshold, None
        if gc.isenabled():  # off: the user collects by hand, and nothing pauses for a freeze to save
            # The young garbage goes now (a young collection is cheap); what is in the oldest
            # generation stays, frozen.
            gc.collect(1)
            gc.freeze()  # moves the generations' lists whole: no object is visited
            # (No gc.get_freeze_count() here: it walks the whole frozen list, 50 ms at 530,000
            # objects, holding the GIL.)
            log.debug("heap frozen after background work")
        current = gc.get_threshold()
        if previous is not None and current[2:] == (_NEVER,):  # not changed meanwhile by the user
            gc.set_threshold(*current[:2], *previous[2:])


HEAP = Heap()
