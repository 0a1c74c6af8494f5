"""Compile workers stopped while a call is served.

Pacing (pacing.py) keeps a background thread off the GIL while a call is served, and the workers'
low priority (priority.py) lets the call's threads take a core; but a compile worker is a process
of its own, and it runs on another core beside the call. On a small machine that alone slows the
call: the memory and caches the two share do not take a priority. Measured on the 2-core CPU (a
one-thread eager transformer call every 20 ms, 5.4 ms at the median): the 99th percentile call
took 7.4 ms alone, 9.0 ms beside a process copying 64 MiB arrays at nice 19 (the longest 29 ms),
and 7.0 ms when that process was stopped for each call.

So while a call is served, the busy workers (starting, or compiling a job) are stopped: SIGSTOP
to each one's process group, which holds its C++ compiler too, sent by the thread that starts the
call (a few microseconds). They are continued (SIGCONT) when no call is served, by a thread of
this module's, not the call's: a continued compiler can take the core of the thread that continues
it for a whole slice of the kernel's (seen on Linux 6.18, the 2-core CPU: the calling thread,
preempted inside the SIGCONT for 2-4.5 ms while the other core idled, in 2% of the calls), and the
call's caller must not wait for that. That thread is woken by each call's end, and so that it does
not take the call's core before the call has returned (at ``SCHED_OTHER`` it did, in a third of
tiny BERT's first-minute calls), it waits at ``SCHED_BATCH`` but for the one wake that must be on
time, a window's start (below; ``priority.wakeup_preemption``); its signals and policy changes go
through libc, with the GIL released and its lock not held. They compile in the gaps between the
calls. Before the next call of a steady stream (arrivals.py) the continuing thread stops them
again, ``arrivals.LEAD`` early, so that the call's thread wakes to an idle core: a worker it
preempts as it wakes stays queued on its core, and the kernel runs it there again at the end of
the call's slice, whatever its priority (EEVDF's eligibility; seen on Linux 6.18 with ftrace, a
compiler exiting for 4 ms in the middle of a call while the other core idled; a process exiting
takes no SIGSTOP). If the call does not come in the window they are continued. Two bounds keep
them from waiting for good, checked as calls start and end:

- once they were kept stopped ``starved`` seconds (pacing's six typical calls) with no gap of a
  typical call's length to run in, the next call runs beside them, and the count starts again: a
  stream with no gaps gives them a share of the time;
- a call or calls that overlap with no gap between them keep them stopped at most ``wait`` seconds
  (pacing's three typical calls), then they run beside the calls until the count of served calls
  reaches zero.

A served call that waits on a worker itself (a model compiling in its call) continues them for
the rest of it (``unblock``); one that waits on something a stopped worker holds (a lock of the
cache's) has them continued by the continuing thread, which looks four times a second while
workers are busy (no more often: a look that falls in a call takes the GIL from it).

A worker that is stopped when its parent dies is not left stopped for good: each worker is in a
process group of its own within the parent's session (``compile_worker.main``), and when a group
with a stopped member loses its last parent outside it, the kernel sends the group SIGHUP then
SIGCONT (POSIX's orphaned process groups), which ends it. Not where the orphans are adopted by a
process of the same session (a subreaper such as ``tini`` with the server in its session): there a
worker the parent left stopped stays stopped until the container ends. A pool that stops its
workers continues them first (``forget``). POSIX only: elsewhere nothing is stopped.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import signal
import threading
import time

from tessera._libc import libc
from tessera.arrivals import NO_WINDOW
from tessera.priority import wakeup_preemption

log = logging.getLogger(__name__)

# Seconds between the continuing thread's looks at workers stopped by a call that may wait on them
# (a few a second, and only while workers are busy: a look that lands in a call takes the GIL).
_LOOK = 0.25
# Seconds after the last call served ends before the background runs again (the workers here, the
# paced threads in pacing.py): the caller's own work with the answer goes first.
GRACE = 0.001
_STOP = getattr(signal, "SIGSTOP", None)
_CONT = getattr(signal, "SIGCONT", None)


class WorkerPause:
    """The busy workers of this process and whether they are stopped (one per process: ``PAUSE``).

    ``call_started`` and ``call_ended`` are called by ``pacing.Pacer.serving`` under its lock, as
    each served call starts and ends, with the count of served calls."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._asked = threading.Condition(self._lock)  # the continuing thread's: work to do
        self._busy: dict[int, int] = {}  # pid -> reasons it is busy (starting, a job)
        self._stopped: list[int] = []  # pids stopped now
        self._since = 0.0  # when they were stopped
        self._resumed = 0.0  # when they were last continued
        self._owed = 0.0  # seconds stopped since they last had a typical call's time to run
        self._to_continue: list[int] = []  # for the continuing thread
        self._to_stop: list[int] = []  # for the continuing thread: ahead of a predicted call
        self._let_run = False  # until no call is served: a call waits on them, or outlasted ``wait``
        # Before a steady stream's predicted next call (arrivals.py): [from, until) in which the
        # busy workers are stopped ahead of it; and whether they are stopped so, no call yet.
        self._window = NO_WINDOW
        self._ahead = False
        self._continuing: threading.Thread | None = None
        self._timely = True  # the continuing thread's wakes preempt (it starts as its creator's)
        self.stops = 0  # the times they were stopped (tests, the benchmark's record)

    @property
    def enabled(self) -> bool:
        return _STOP is not None and hasattr(os, "killpg")

    def busy(self, pid: int) -> None:
        """Worker ``pid`` is starting or compiling: stopped while calls are served, from the next."""
        if not self.enabled:
            return
        with self._lock:
            self._busy[pid] = self._busy.get(pid, 0) + 1
            self._asked.notify()  # the continuing thread looks while workers are busy

    def idle(self, pid: int) -> None:
        """Take back one ``busy``; a worker no longer busy is left alone (continued if stopped)."""
        with self._lock:
            left = self._busy.get(pid, 0) - 1
            if left > 0:
                self._busy[pid] = left
                return
        self.forget(pid)

    def forget(self, pid: int) -> None:
        """Worker ``pid`` is being stopped or has ended: never stopped again, continued if it is."""
        with self._lock:
            self._busy.pop(pid, None)
            stopped = pid in self._stopped or pid in self._to_continue
            if pid in self._stopped:
                self._stopped.remove(pid)
                self._ahead = self._ahead and bool(self._stopped)
            if pid in self._to_continue:  # continued here, not taken for stopped by the next call
                self._to_continue.remove(pid)
            if pid in self._to_stop:
                self._to_stop.remove(pid)
        if stopped:  # from a pool's thread as a job ends, beside the calls: as the others, unlocked
            _signal(pid, _CONT, hold_gil=False)

    def call_started(self, serving: int, wait: float, starved: float, typical: float) -> None:
        """A call began, ``serving`` calls with it: the first stops the busy workers (see the
        module's doc for ``wait``, ``starved`` and ``typical``); a later one lets them run if they
        were stopped ``wait`` seconds."""
        if not self._busy:  # no worker busy: one read, no lock
            self._window = NO_WINDOW  # a call came: a worker busy from now on is not stopped ahead
            return
        with self._lock:
            now = time.perf_counter()
            self._window = NO_WINDOW
            ahead, self._ahead = self._ahead, False
            if serving > 1 or self._let_run:
                self._outlasted(now, wait)
                return
            if now - self._resumed >= typical:
                self._owed = 0.0
            if self._owed >= starved:  # this call runs beside them
                self._owed = 0.0
                if ahead:
                    self._continue(now)
                return
            # The last call's continue has not gone out (its GRACE), or they were stopped ahead of
            # this call: those workers are stopped still and stay so; a worker busy since then is
            # stopped now. SIGSTOP is sent here, by the calling thread: it must be in before the
            # call's first op, and it takes the sender a few microseconds (only SIGCONT wakes
            # anything).
            kept = self._to_continue + [pid for pid in self._stopped if pid not in self._to_continue]
            self._to_continue = []
            self._stopped = kept + [pid for pid in self._busy if pid not in kept and _signal(pid, _STOP)]
            if self._stopped and not ahead:
                self._since = now
                self.stops += 1
                if self._continuing is None:
                    self._continuing = threading.Thread(
                        target=self._continue_asked, name="tessera-worker-pause", daemon=True
                    )
                    self._continuing.start()

    def call_ended(self, serving: int, wait: float, window: tuple[float, float] = NO_WINDOW) -> None:
        """A call ended, ``serving`` calls left: at none, the workers are continued, and stopped
        again in ``window`` (perf_counter seconds, [from, until)) unless a call starts first: the
        next call of a steady stream is due then (arrivals.py)."""
        if not self._stopped and not self._let_run and (not self._busy or window[0] == math.inf):
            if not serving:  # for a worker busy from now on (``busy`` wakes the continuing thread)
                self._window = window
            return
        with self._lock:
            now = time.perf_counter()
            if serving:
                self._outlasted(now, wait)
                return
            self._let_run = False
            self._window = window
            self._continue(now)
            self._asked.notify()

    def unblock(self) -> None:
        """The calling thread, serving a call, waits on a worker: they run until no call is served."""
        with self._lock:
            self._let_run = True
            self._continue(time.perf_counter())

    def stopped(self) -> list[int]:
        with self._lock:
            return list(self._stopped)

    def _ahead_of_call(self, now: float) -> float:
        # Under the lock, in the continuing thread: the busy workers stopped in the window before a
        # predicted call, continued at its end if the call did not come. Seconds until the next
        # change (inf: none).
        start, until = self._window
        if self._ahead and now >= until:  # the prediction missed: they run again
            self._ahead, self._window = False, NO_WINDOW
            self._continue(now)
            return 0.0
        if now < start or start == math.inf:
            return start - now
        if not (self._ahead or self._stopped or self._to_continue or self._let_run) and now < until:
            # Taken for stopped from now on (a call that starts sends no SIGSTOP of its own); the
            # signals go out after the lock is released (``_send_stops``).
            self._stopped, self._to_stop = list(self._busy), list(self._busy)
            self._ahead, self._since = bool(self._stopped), now
            self.stops += self._ahead
        return until - now if self._ahead else math.inf

    def _send_stops(self) -> None:
        # The continuing thread's SIGSTOPs ahead of a call, outside the lock and without the GIL:
        # the kernel may preempt the sender in the system call (a compiler at SCHED_IDLE that has
        # not run is eligible to), and a sender that held either would keep the call waiting
        # (``benchmarks/gil_holders.py``: a 3.2 ms ``kill`` on tiny ViT's first minute).
        with self._lock:
            pids, self._to_stop = self._to_stop, []
        self._stop_unlocked(pids)

    def _stop_unlocked(self, pids: list[int]) -> None:
        # SIGSTOP ``pids`` outside the lock; then any no longer counted as stopped (forgotten
        # meanwhile, and so continued before its SIGSTOP; perhaps busy again since) is continued,
        # or it would stay stopped with nothing to continue it. One continued by a call's end
        # meanwhile is in ``_to_continue``: the next round continues it.
        for pid in pids:
            _signal(pid, _STOP, hold_gil=False)
        with self._lock:
            loose = [pid for pid in pids if pid not in self._stopped and pid not in self._to_continue]
        for pid in loose:
            _signal(pid, _CONT, hold_gil=False)

    def _outlasted(self, now: float, wait: float) -> None:
        # Under the lock: calls with no gap between them kept the workers stopped for ``wait``.
        if self._stopped and now - self._since >= wait:
            self._let_run = True
            self._continue(now)

    def _continue(self, now: float) -> None:
        # Under the lock: the continuing thread sends the SIGCONTs.
        self._ahead = False
        if not self._stopped:
            return
        self._to_continue.extend(self._stopped)
        self._stopped = []
        self._owed += now - self._since
        self._resumed = now
        self._asked.notify()

    def _continue_asked(self) -> None:
        while True:
            try:
                self._continue_once()
            except Exception:  # a worker left stopped for good would never answer: never end here
                log.exception("continuing the compile workers failed; trying again")
                with self._lock:
                    self._to_continue.extend(p for p in self._busy if p not in self._to_continue)
                    self._asked.wait(_LOOK)  # not a loop that spins on a failure that lasts

    def _continue_once(self) -> None:
        with self._lock:
            while not self._to_continue:
                # While workers are busy, a look every _LOOK seconds: a call that waits on
                # something a stopped worker holds (a lock of the cache's) ends that way.
                timeout = self._ahead_of_call(time.perf_counter())
                # Only a wake at a window's start must be on time: the workers are stopped before
                # the call's thread wakes. Any other (a call's end, the end of a window whose call
                # came, a look) waits for the core's next switch rather than take a served call's.
                timely = not self._ahead and time.perf_counter() < self._window[0] < math.inf
                if self._to_stop or timely != self._timely:
                    break  # signals and the policy outside the lock, then round again
                self._asked.wait(min(timeout, _LOOK) if self._busy else None)
                now = time.perf_counter()
                if self._stopped and not self._ahead and now - self._since >= _LOOK:
                    log.debug(
                        "a served call kept the compile workers stopped %.2fs: let run", now - self._since
                    )
                    self._let_run = True
                    self._continue(now)
                elif self._to_continue and not self._let_run:
                    # A call just ended: its caller's own work after it goes first, as a paced
                    # thread's does (GRACE). A call that starts meanwhile keeps them.
                    left = self._resumed + GRACE - now
                    if left > 0:
                        self._asked.wait(left)
            else:
                timely = self._timely
            pids, self._to_continue = self._to_continue, []
        self._send_stops()
        if timely != self._timely:  # only this thread changes it
            self._timely = timely
            wakeup_preemption(timely)
        for pid in pids:  # outside the lock: a call that starts meanwhile does not wait for it
            _signal(pid, _CONT, hold_gil=False)
        with self._lock:
            # A call started between the lock's release and the signal: stopped again for it.
            again = [pid for pid in pids if pid in self._stopped]
        self._stop_unlocked(again)

    def after_fork(self) -> None:
        """A forked child has none of these workers, nor the continuing thread."""
        self._reset()


def _signal(pid: int, sig: signal.Signals | None, hold_gil: bool = True) -> bool:
    """Send ``sig`` to worker ``pid``'s process group (to ``pid`` alone before the worker made its
    group); False where it is gone. ``hold_gil=False``: through libc, with the GIL released, so that
    a sender the kernel preempts in the call holds nothing the served calls need."""
    assert sig is not None
    if not hold_gil:
        import ctypes

        # Reason: os.killpg holds the GIL through the system call; a ctypes call releases it.
        if libc().killpg(pid, int(sig)) == 0:
            return True
        if ctypes.get_errno() != errno.ESRCH:
            return False
    else:
        try:
            os.killpg(pid, sig)
            return True
        except ProcessLookupError:
            pass
        except PermissionError as e:  # not ours any more (a reused number): left alone
            log.debug("cannot signal compile worker %d: %s", pid, e)
            return False
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_worker(pid: int) -> bool:
    """SIGKILL worker ``pid`` with the compilers it started (its process group): a worker given up
    on for a C++ compile that never ended leaves none running. False where there is no SIGKILL."""
    sig = getattr(signal, "SIGKILL", None)
    return sig is not None and hasattr(os, "killpg") and _signal(pid, sig)


PAUSE = WorkerPause()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PAUSE.after_fork)
