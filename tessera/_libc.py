"""The C library's own functions, for the few system calls that must not hold the GIL.

``os.killpg`` and ``os.sched_setscheduler`` hold the GIL through the system call, and the kernel may
switch to another task inside it (a signal that wakes a process, a policy change): a background
thread preempted there would keep a served call waiting for the GIL. A ``ctypes`` call releases
the GIL for its length. POSIX only.
"""

from __future__ import annotations

import functools
from typing import Any


@functools.cache
def libc() -> Any:
    """The process's C library (its global symbols: no search for the library's file, which
    ``ctypes.util.find_library`` does by running a program), with ``errno`` kept for
    ``ctypes.get_errno``."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True)
