"""Background work that gives way to the calls a process serves.

A trace or a compile in a background thread is Python, and holds the GIL between its bytecodes. A
call served meanwhile releases the GIL in every op and must win it back: CPython hands it over only
after the switch interval (5 ms), so each op of a served call could wait 5 ms, and a 3 ms eager
call was seen to take 470 ms beside a Dynamo trace (the toy Llama, 4 layers, 2-core CPU). So the
background threads are *paced*: each runs under a trace function that, while a call is being
served, waits until it ends (the GIL is then the served call's alone), and the switch interval is
shortened while one runs, so a call that starts gets the GIL at once. Under a stream with no gap
between calls the background would never run; it then takes a slice of a third of a served call's
typical time after waiting six of them with no gap of one between, so a call is slower by a
fraction of itself, and the background still finishes (under a stream with gaps it runs in the
gaps). A call that lasts more than three times the typical one may be waiting for what the
background holds (a lock, the trace it needs): the background then runs as long as it waited before
it waits again, so no call waits long on a background that waits on it, and a call slow for another
reason is not slowed further for all its length. Three, not two: a call the background runs beside
waits for the GIL at each of its ops, and a call slow for another reason (the machine) at twice the
typical one was made 3-4x by it (tiny BERT's eager calls beside its trace, 2-core CPU: 1.2-4.6 ms
of GIL waits in calls of 4-8 ms, ``benchmarks/first_minute.py --gil-clock``); a typical call learnt
from compiled calls is also shorter than eager's. A call served as traced while compiles run also
leaves them a core (``served_threads.py``): pacing frees the GIL, and that frees a core. The
compile workers, processes of their own, are stopped while a call is served, within the same bounds
(``worker_pause.py``). After a call ends the background waits ``GRACE`` (1 ms) more, so that its
caller's own work with the answer goes first; before the next call of a steady stream it stops
``arrivals.LEAD`` (2 ms) early, so that the call's thread finds the GIL and a core free as it wakes
(arrivals.py); and the trace function, on 'call' events, traces the lines of the few functions a
trace runs for milliseconds without a call (``_compat.LONG_RUNNING``).

A served call is counted by ``PACER.serving()``, entered by ``CompiledModel.__call__`` only while
some background thread is paced (``PACER.threads``, one attribute read otherwise). The trace
function costs the background thread about 1.8x its time (measured on a Dynamo trace, Python
3.11): the price of serving at eager's speed while the trace and the compiles run.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from tessera import _compat, served_threads
from tessera.arrivals import Arrivals
from tessera.worker_pause import GRACE, PAUSE

_SLICE = 1 / 3  # of a typical call: what the background may take while a call is served
_WAIT = 3.0  # typical calls the background waits before it runs beside a long call
_MIN_WAIT = 0.002
_STARVED = 6.0  # typical calls waited, in all, before the background takes a slice
_SWITCH = 0.00005  # seconds: the switch interval while a thread is paced


class Pacer:
    """The process's served calls and paced threads (one per process: ``PACER``)."""

    def __init__(self) -> None:
        self.threads = 0  # read by every served call: nonzero while some background thread is paced
        self._local = threading.local()  # ``depth``: the served calls this thread is in
        self._lock = threading.Lock()
        self._serving = 0
        self._quiet = threading.Event()  # set while no call is being served
        self._quiet.set()
        self._busy = threading.Event()  # set while one is
        # The steady stream's next call, predicted: paced threads stop before it (arrivals.py).
        self.arrivals = Arrivals()
        self._ended = 0.0  # perf_counter when the last call served ended
        # A served call's typical time (seconds), an average that an outlier moves little: the
        # background's slice and wait under a stream with no gaps scale with it. A guess until the
        # first call is counted or measured (``measured``).
        self.typical = 0.005
        self._known = False
        self._interval: float | None = None  # the switch interval before, while a thread is paced
        # Compiles running beside the served calls (compile threads, busy compile workers), each
        # left a core by the calls served as traced (served_threads.py).
        self.compiles = 0

    @contextlib.contextmanager
    def serving(self, eagerly: bool = False) -> Iterator[None]:
        """Count a call being served: paced background threads wait while one is. A call not
        served ``eagerly`` leaves a core to each compile running (served_threads.py)."""
        local = self._local
        local.depth = getattr(local, "depth", 0) + 1
        with self._lock:
            self._serving += 1
            if self._serving == 1:
                self._quiet.clear()
                self._busy.set()
                self.arrivals.started(time.perf_counter())
            typical = self.typical
            PAUSE.call_started(self._serving, max(_MIN_WAIT, _WAIT * typical), _STARVED * typical, typical)
        full = None if eagerly or not self.compiles else served_threads.leave_cores(self.compiles)
        start = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - start
            if full is not None:
                served_threads.put_back(full)
            with self._lock:
                self._serving -= 1
                if not self._serving:
                    self._ended = time.perf_counter()
                    self._busy.clear()
                    self._quiet.set()
                    self.arrivals.ended(self._ended)
                PAUSE.call_ended(self._serving, max(_MIN_WAIT, _WAIT * self.typical), self.arrivals.window)
                self._known = True
                self.typical = 0.8 * self.typical + 0.2 * min(took, 2 * self.typical)
            local.depth -= 1

    def in_call(self) -> bool:
        """Whether the calling thread is serving a call (counted by ``serving``)."""
        return bool(getattr(self._local, "depth", 0))

    def measured(self, seconds: float) -> None:
        """A call's time measured before any call was counted (the eager call that starts the first
        trace): the typical call from then on, in place of the guess. An average that moves at most
        1.2x a call would otherwise take a dozen calls to reach a 20 ms call's time from 5 ms, and
        until then a paced thread takes a call 2.5x as long as the guess for a call it may wait on
        and runs beside it (the toy Llama at 16 layers, 2-core CPU: its first calls beside the
        trace at 2.1-2.6x eager's). A first call is slower than the later ones: the guess then errs
        long, and a paced thread waits more, not less."""
        with self._lock:
            if not self._known:
                self._known = True
                self.typical = max(seconds, _MIN_WAIT)

    def expect(self) -> None:
        """Count a paced thread about to start, from the thread that starts it: calls served from
        now on are counted, so none runs uncounted beside a thread not yet in ``paced``. The
        thread's ``paced(counted=True)`` takes the count back when it ends."""
        with self._lock:
            self._count(1)

    def not_started(self) -> None:
        """Take back ``expect``'s count of a thread that did not start."""
        with self._lock:
            self._count(-1)

    def _count(self, change: int) -> None:
        """threads += change, under the lock; the switch interval shortened while it is nonzero."""
        self.threads += change
        # Reason: a call that starts while a paced thread runs waits for the GIL until the switch
        # interval forces it over (5 ms by default, as long as a small model's whole call); at
        # 50 us it starts at once, and then the paced thread waits. Measured (tiny ViT eager calls
        # 20 ms apart beside a paced Dynamo trace, 2-core CPU): the median wait for the GIL after
        # the gap, 0.20 ms alone, was 0.45 ms at 0.2 ms and 0.30 ms at 50 us; 20 us gained nothing
        # more (the kernel's timer slack). Put back when none is paced.
        if change > 0 and self.threads == change:
            self._interval = sys.getswitchinterval()
            sys.setswitchinterval(min(self._interval, _SWITCH))
        elif self.threads == 0 and self._interval is not None:
            if abs(sys.getswitchinterval() - min(self._interval, _SWITCH)) < 1e-6:  # not changed since
                sys.setswitchinterval(self._interval)
            self._interval = None

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """Count a compile running beside the served calls (a compile thread, a compile worker's
        job) for its whole length."""
        with self._lock:
            self.compiles += 1
        try:
            yield
        finally:
            with self._lock:
                self.compiles -= 1

    @contextlib.contextmanager
    def paced(self, counted: bool = False) -> Iterator[None]:
        """Run the body (in a background thread) giving way to served calls: see the module's
        doc. Python's trace function is per thread: the calling thread only is paced.
        ``counted``: the starting thread called ``expect`` for it."""
        previous = sys.gettrace()
        # The end of the slice taken while calls are served; the seconds waited since the last.
        until, waited = [0.0], [0.0]
        is_quiet, wait, now, sleep = self._quiet.is_set, self._quiet.wait, time.perf_counter, time.sleep
        called, arrivals = self._busy.wait, self.arrivals

        def give_way(frame: Any, event: str, arg: Any) -> None:
            at = now()
            if at < until[0]:
                return None
            if is_quiet():
                # A call just ended: what its caller does with the answer (returning through the
                # wrappers, sending it) needs the GIL too, and a background that takes it at once
                # may hold it in a C call for milliseconds (tiny ViT, 2-core CPU, ftrace: a call's
                # body done in 2.4 ms, its return 9 ms later, behind the trace thread in a 4 ms C
                # call). So the background waits a little longer, counted as waiting.
                left = self._ended + GRACE - at
                if left > 0:
                    sleep(left)
                    waited[0] += left
                    if is_quiet():
                        return None
                else:
                    if waited[0] and at - self._ended > self.typical:
                        waited[0] = 0.0  # a gap of a typical call: ran in it, not starved
                    # The next call of a steady stream is due: stopped before it starts, so its
                    # thread finds the GIL and a core free (arrivals.py). Not counted as waited:
                    # the stream leaves gaps.
                    due_from, due_until = arrivals.window
                    if not due_from <= at < due_until:
                        return None
                    called(due_until - at)
                    if is_quiet():
                        return None
            start = now()
            longest = max(_MIN_WAIT, _WAIT * self.typical)
            if not wait(longest):
                # A call far longer than the typical one: it may wait for what this thread holds
                # (a lock, a trace it needs), so this thread runs as long as it waited, then waits
                # again: it finishes what the call waits for at half speed, and a call slow for
                # another reason is not slowed further for all its length.
                until[0] = now() + longest
                return None
            waited[0] += now() - start
            if waited[0] > _STARVED * self.typical:  # calls without a pause: a slice, then on
                until[0], waited[0] = now() + _SLICE * self.typical, 0.0
            return None

        long_running = _compat.LONG_RUNNING

        def on_lines(frame: Any, event: str, arg: Any) -> Any:
            give_way(frame, event, arg)
            return on_lines

        def on_calls(frame: Any, event: str, arg: Any) -> Any:
            give_way(frame, event, arg)
            # Code that runs for milliseconds without a call would hold the GIL beside a served
            # call for all that time, half of each of its ops: its lines are traced too.
            code = frame.f_code
            file = long_running.get(code.co_name)
            return on_lines if file is not None and code.co_filename.endswith(file) else None

        if not counted:
            with self._lock:
                self._count(1)
        # Reason: waiting in a trace function hands the GIL over at once; on 'call' events only (no
        # line events but in ``_compat.LONG_RUNNING``'s functions): the cheapest hook CPython
        # 3.10-3.13 all have. A debugger's trace function, if any, is put back after.
        sys.settrace(on_calls)
        try:
            yield
        finally:
            sys.settrace(previous)
            with self._lock:
                self._count(-1)


PACER = Pacer()
