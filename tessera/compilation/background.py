"""The one way tessera starts a background thread (a background compile, the learning of sizes, a
trace beside eager), and the process's exit, which such a thread does not hold up.

Light: a first call served eagerly starts its trace without importing the compile machinery.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from typing import Any

from tessera import _compat

log = logging.getLogger(__name__)

# Set as the interpreter begins to exit (before it joins its threads), once the threads that
# finish at exit have ended: background work stops at its next step, the compile workers are
# ended, and what was obtained is kept in the cache.
CLOSING = threading.Event()
_at_close: list[Callable[[], None]] = []  # run once CLOSING is set (the pool's stop, compile_pool.py)
_finishing: list[threading.Thread] = []  # threads the exit waits for (CompileConfig.finish_at_exit)


class Closing(Exception):
    """Raised in a background thread that must stop because the process exits."""


def check_open() -> None:
    """Raise ``Closing`` in a background thread once the process has begun to exit."""
    if CLOSING.is_set():
        raise Closing("the process is exiting")


def at_close(fn: Callable[[], None]) -> None:
    """Run ``fn`` as the process begins to exit, before its threads are joined."""
    _at_close.append(fn)


def _close() -> None:
    try:
        while any(t.is_alive() for t in _finishing):  # a trace's thread may start a compile's
            for thread in list(_finishing):
                thread.join()
    except KeyboardInterrupt:  # Ctrl-C during the wait: the exit goes on at once, quietly
        log.info("interrupted while the background compiles finished; the next process compiles the rest")
    CLOSING.set()
    for fn in reversed(_at_close):
        try:
            fn()
        except Exception as e:  # an exit goes on whatever a clean-up meets
            log.debug("at exit: %s: %s", type(e).__name__, e)


_compat.before_thread_joins(_close)


def _run(context: contextvars.Context, fn: Callable[..., None], *args: Any) -> None:
    with _compat.rng_left_alone():
        context.run(fn, *args)


def start_thread(
    name: str, fn: Callable[..., None], *args: Any, finish_at_exit: bool = False
) -> threading.Thread | None:
    """Run ``fn(*args)`` in a thread of its own; None, and nothing run, once the process exits.

    Not a daemon, so that no thread runs torch code while the interpreter tears itself down; it
    does not hold the exit up either: ``CLOSING`` is set before the interpreter joins it, and the
    work checks it (``check_open``) between steps. With ``finish_at_exit`` the exit waits for it
    first (Ctrl-C ends the wait). A compile in another thread must not make this
    process's other torch.compile'd functions think they are being FX-traced (torch 2.11-2.13,
    see _compat.isolate_fx_tracing). It runs in a copy of this thread's context: Inductor's and
    Dynamo's settings are context variables (torch 2.13: ``config.x = v`` sets a ContextVar), and
    a new thread starts with an empty context, so the user's settings, which the cache key has
    read, would be missing from the compile. Its compiles leave the global random generator alone
    (``_compat.rng_left_alone``): the user's draws meanwhile are not undone. No process-wide state
    is changed for it: no priority, no switch interval, no trace function, no garbage collector
    setting."""
    if CLOSING.is_set():
        return None
    _compat.isolate_fx_tracing()
    _compat.settle_device_guards()
    # Here, where Dynamo is loaded: a thread importing its modules races the user's imports.
    _compat.leave_rng_alone_where_loaded()
    context = contextvars.copy_context()
    thread = threading.Thread(target=_run, args=(context, fn, *args), name=name, daemon=False)
    thread.start()
    if finish_at_exit:
        _finishing[:] = [t for t in _finishing if t.is_alive()]
        _finishing.append(thread)
    return thread
