"""The CPU priority of tessera's compile worker processes (``CompileConfig.background_priority``).

A worker is a process of tessera's own: it lowers itself as it starts, before torch's import, so
that its compiles take the cores only when the calls the parent serves leave them. The parent's
threads are never lowered: a thread's priority is inherited by every thread it starts (Inductor's
kernel-compile pool among them), so a lowered thread would lower the user's own later compiles.

- ``"low"`` (the default): nice 19, a share of a busy machine, so a compile ends under any load.
- ``"idle"``: Linux's ``SCHED_IDLE`` where the system allows it (else nice 19): the worker runs only
  on a core nothing else wants.
- ``"normal"``: unchanged.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

LOW_NICE = 19


def lower_process(priority: str) -> bool:
    """Lower this whole process's CPU priority to ``priority`` (a compile worker, as it starts);
    True when it was lowered. A system that refuses leaves it as it is."""
    if priority == "normal" or not hasattr(os, "setpriority"):
        return False
    try:
        if priority == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, 0, LOW_NICE)
    except OSError as e:  # a sandbox that forbids it
        if priority == "idle":
            return lower_process("low")
        log.debug("cannot lower this process's priority to %r: %s", priority, e)
        return False
    return True
