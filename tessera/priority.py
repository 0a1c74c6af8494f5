"""The CPU priority of the work a process does beside the calls it serves.

Pacing (pacing.py) keeps a background trace or compile off the GIL while a call is served, but not
off the cores: Inductor's C++ compiler and its Python run beside the served call's intra-op
threads, and on a small machine those wait for a core (the toy Llama, 2-core CPU: 267 of 1,968
first-minute calls over 2x eager's median; 55 of 2,229 at "low", benchmarks/first_minute.py,
docs/serving.md). So each background thread lowers
its own priority as it starts, and the compiler processes it starts inherit it: a served call's
threads then take a core the moment they want one.

- ``"low"`` (the default): nice 19. The background still gets a share of a busy machine (about
  1.5% of a core per busy thread), so a compile finishes under any load, and a background thread
  that holds the GIL when a call starts is not starved for long.
- ``"idle"``: Linux's ``SCHED_IDLE``: the background runs only on a core nothing else wants.
  No better than ``"low"`` in two 40 s runs of the toy Llama on the 2-core CPU; on a machine kept
  busy, a background thread holding the GIL can then keep a served call waiting until a core frees.
- ``"normal"``: unchanged.

Only Linux lowers one thread (elsewhere a priority is the whole process's, so a thread is left
as it is); compile worker processes (compile_pool.py) are lowered whole, on any POSIX system, and
at "low" they run at ``SCHED_IDLE`` where Linux has it. A worker holds nothing a served call
needs (no GIL of this process's), and it is stopped while a call is served (worker_pause.py), so
what ``"idle"`` costs a thread does not apply, and what nice 19 costs the calls does: a call
whose thread wakes while a nice-19 compiler has its core waits for the compiler's slice (2.5-4.5 ms
on Linux 6.18, whose scheduler lets it finish its slice), and one at ``SCHED_IDLE`` is preempted at
once. Measured on the 2-core CPU, 40 s first minutes of tiny BERT and ViT with the workers stopped
in the calls (``python -m benchmarks.first_minute --models bert,vit --seconds 40 --threads 1
--gil-clock``): calls over 2x eager's median 27 and 27 with nice-19 workers, 14 and 10 with
``SCHED_IDLE`` ones. The price: on a machine whose every core is kept busy, a worker at
``SCHED_IDLE`` gets no time where one at nice 19 got about 1.5% of a core, and its compiles land
after the load, not during it. A
priority, once lowered, stays so for the thread's life: each background thread is tessera's own
and ends with its work. Threads it starts inherit it, Inductor's kernel-compile pool among them:
a later compile in this process that uses that pool runs low too, and a pool started earlier by a
thread at normal priority (the user's own ``torch.compile``) keeps its priority.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from tessera._libc import libc

log = logging.getLogger(__name__)

PRIORITIES = ("low", "idle", "normal")
LOW_NICE = 19


def lower_thread(priority: str) -> bool:
    """Lower the calling thread's CPU priority to ``priority``; True when it was lowered."""
    if priority == "normal" or not sys.platform.startswith("linux"):
        return False
    return _lower(threading.get_native_id(), priority)


def lower_process(priority: str) -> bool:
    """Lower this whole process's CPU priority (a compile worker, as it starts, before it starts
    any thread): at "low" as at "idle" where Linux has ``SCHED_IDLE`` (see the module's doc)."""
    if priority == "normal" or not hasattr(os, "setpriority"):
        return False
    if priority == "low" and sys.platform.startswith("linux") and _lower(0, "idle"):
        return True
    return _lower(0, priority)


def wakeup_preemption(on: bool) -> bool:
    """Whether the calling thread's wake-ups may preempt the thread running on the core it wakes on
    (Linux: ``SCHED_OTHER`` when ``on``, ``SCHED_BATCH`` when not, at the thread's own nice
    value); True when it was set.

    For a thread a served call wakes as it ends (worker_pause.py's continuing thread): at
    ``SCHED_OTHER`` it took the call's core at once, before the call had returned to its caller
    (Linux 6.18, the 2-core CPU, ftrace: in 644 of 1,820 calls of tiny BERT's first 40 s, ~20 us
    each), though it has nothing to do for ``worker_pause.GRACE``. A batch thread waits for the
    core's next switch or tick (4 ms at 250 Hz), or runs on an idle core: so a wake that must be
    on time (the workers stopped before a predicted call) is made with it on."""
    if not (sys.platform.startswith("linux") and hasattr(os, "SCHED_BATCH")):
        return False
    import ctypes

    # Reason: os.sched_setscheduler holds the GIL through the system call, and a policy change
    # may switch the core to another task in it (a compiler at SCHED_IDLE that has not run is
    # eligible): ``benchmarks/gil_holders.py`` saw it hold the GIL 2.7 ms. A ctypes call releases
    # the GIL. On Linux, pid 0 is the calling thread.
    priority = ctypes.c_int(0)  # struct sched_param: its one field
    policy = os.SCHED_OTHER if on else os.SCHED_BATCH
    if libc().sched_setscheduler(0, policy, ctypes.byref(priority)) != 0:
        # A sandbox that forbids it: the thread wakes as any other.
        log.debug("cannot change this thread's scheduling policy: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def _lower(who: int, priority: str) -> bool:
    # On Linux a thread is a task of its own: PRIO_PROCESS and sched_setscheduler with a thread's
    # id (or 0, the caller) change that thread only; elsewhere ``who`` 0 is the process.
    try:
        if priority == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(who, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, who, LOW_NICE)
    except OSError as e:  # a sandbox that forbids it: the background runs at the caller's priority
        log.debug("cannot lower the priority of %s to %r: %s", who or "this process", priority, e)
        return False
    return True
