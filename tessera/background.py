"""The one way tessera starts a background thread (a trace beside eager, a background compile, the
learning of sizes): paced, lowered, holding the heap. Apart from schedule.py so that a first call
served eagerly starts its trace without importing the compile machinery.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable
from typing import Any

from tessera import _compat
from tessera.heap import HEAP
from tessera.pacing import PACER
from tessera.priority import lower_thread

# The threads a background thread started once the interpreter had begun to exit: its own to join.
_LATE = threading.local()


def _paced(priority: str, compiles: bool, freeze_heap: bool, fn: Callable[..., None], *args: Any) -> None:
    _LATE.threads = []
    try:
        lower_thread(priority)
        # At "normal" priority nothing gives way on the cores: the served calls keep every thread.
        compiling = PACER.compiling() if compiles and priority != "normal" else contextlib.nullcontext()
        with PACER.paced(counted=True), compiling:
            fn(*args)
    finally:
        for late in _LATE.threads:  # the exit's hook joins this thread, so these end first too
            late.join()
        if freeze_heap:  # held by start_thread
            HEAP.release()


def start_thread(
    name: str,
    fn: Callable[..., None],
    *args: Any,
    priority: str,
    compiles: bool = False,
    freeze_heap: bool = True,
) -> threading.Thread:
    """Run ``fn(*args)`` in a compile thread of its own (the background compile, the learning).

    Not a daemon: a process that exits first waits for it, and the cache gets every artifact. A
    compile in another thread must not make this process's other torch.compile'd functions think
    they are being FX-traced, nor send the modules they call into its FX trace (torch 2.11-2.13,
    see _compat.isolate_fx_tracing). It runs in a copy of this thread's context: Inductor's and
    Dynamo's settings are context variables (torch 2.13: ``config.x = v`` sets a ContextVar), and
    a new thread starts with an empty context, so the user's settings, which the cache key has
    read, would be missing from the compile. It gives way to the calls being served (pacing.py), on
    the GIL and, at ``priority`` (``CompileConfig.background_priority``), on the cores
    (priority.py); a thread that ``compiles`` is also left a core by the calls served as traced
    (served_threads.py). With ``freeze_heap`` (``CompileConfig.freeze_heap``) no full garbage
    collection pauses the served calls while it runs (heap.py)."""
    _compat.isolate_fx_tracing()
    _compat.settle_device_guards()
    context = contextvars.copy_context()
    run = (_paced, priority, compiles, freeze_heap, fn, *args)
    thread = threading.Thread(target=context.run, args=run, name=name, daemon=False)
    PACER.expect()
    if freeze_heap:
        HEAP.hold()
    try:
        thread.start()
    except BaseException:
        PACER.not_started()
        if freeze_heap:
            HEAP.release()
        raise
    if not _compat.join_before_pools_shut(thread):
        # Started by a background thread after the exit's hooks began (a compile a trace or a
        # compile starts then): too late for a hook of its own, so its starter joins it. (A thread
        # the main thread starts then has no starter to wait for it: none of tessera's does.)
        getattr(_LATE, "threads", []).append(thread)
    return thread
