"""Compile workers are stopped while a call is served and run between the calls (worker_pause.py):
real processes for the stop and the continue, a made-up clock for the bounds."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tessera import worker_pause
from tessera.arrivals import Arrivals
from tessera.compile_pool import CompilePool
from tessera.fan_out import unblock_workers
from tessera.pacing import PACER
from tessera.worker_pause import PAUSE, WorkerPause

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads a process's state from /proc (Linux)"
)
SPIN = "from tessera.compile_worker import _own_group; _own_group()\nwhile True: pass"


def _state(pid: int) -> str:
    """A process's state letter (R running, S sleeping, T stopped, Z ended); "" once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def _until(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def _becomes(pid: int, state: str, what: str, timeout: float = 10.0) -> None:
    """Wait until process ``pid`` is in ``state`` (a ``_state`` letter)."""
    _until(lambda: _state(pid) == state, what, timeout)


@pytest.fixture
def signals_sent(monkeypatch) -> list[tuple[int, int, float]]:
    """Each signal worker_pause sends, as it is sent: (signal, the sending thread, when)."""
    sent: list[tuple[int, int, float]] = []
    real = worker_pause._signal

    def recording(pid, sig, hold_gil=True):
        sent.append((sig, threading.get_ident(), time.perf_counter()))
        return real(pid, sig, hold_gil)

    monkeypatch.setattr(worker_pause, "_signal", recording)
    return sent


@pytest.fixture(autouse=True)
def _long_typical_call(monkeypatch):
    """Calls of PACER's (the real tests') are taken to be a second long typically: what earlier
    tests served leaves no short typical call whose bounds (a call beside the workers after six
    of them stopped with no gap) would let one of these calls run beside a worker. The bounds
    have tests of their own, on a made-up clock."""
    monkeypatch.setattr(PACER, "typical", 1.0)
    monkeypatch.setattr(PACER, "arrivals", Arrivals())  # no stream learnt from earlier tests


@pytest.fixture
def spinner() -> Iterator[int]:
    """A process busy on a core, in a group of its own as a compile worker is."""
    process = subprocess.Popen([sys.executable, "-c", SPIN], env={**os.environ, "PYTHONPATH": os.getcwd()})
    _until(lambda: os.getpgid(process.pid) == process.pid, "the spinner made its group")
    yield process.pid
    PAUSE.forget(process.pid)
    process.kill()
    process.wait()


@linux_only
def test_a_busy_worker_is_stopped_for_each_served_call_and_runs_between_them(spinner):
    PAUSE.busy(spinner)
    try:
        for _ in range(3):
            stops = PAUSE.stops
            with PACER.serving():
                assert PAUSE.stopped() == [spinner]
                _becomes(spinner, "T", "the spinner is stopped in the call", 1.0)
            assert PAUSE.stops == stops + 1
            _becomes(spinner, "R", "the spinner runs again after the call")
    finally:
        PAUSE.idle(spinner)
    with PACER.serving():  # no longer busy: left alone
        assert PAUSE.stopped() == []
        assert _state(spinner) == "R"


@linux_only
def test_the_continue_goes_out_from_a_thread_of_its_own_not_the_calling_one(spinner, signals_sent):
    # A continued compiler can take the sender's core for a whole slice of the kernel's: the call's
    # caller must not wait for that.
    senders = signals_sent
    PAUSE.busy(spinner)
    try:
        with PACER.serving():
            _becomes(spinner, "T", "the spinner is stopped in the call", 1.0)
        _until(lambda: any(sig == signal.SIGCONT for sig, *_ in senders), "a SIGCONT went out")
        _becomes(spinner, "R", "the spinner runs again")
    finally:
        PAUSE.idle(spinner)
    me = threading.get_ident()
    assert (signal.SIGSTOP, me) in [(sig, who) for sig, who, _ in senders]
    continued = [who for sig, who, _ in senders if sig == signal.SIGCONT]
    assert continued and me not in continued
    # Woken as a call ends, it must not take the call's core before the call returns.
    (thread,) = [t for t in threading.enumerate() if t.ident in continued]
    tid = thread.native_id
    assert tid is not None
    _until(lambda: os.sched_getscheduler(tid) == os.SCHED_BATCH, "the continuing thread waits at batch")


@linux_only
def test_the_workers_are_continued_a_grace_after_the_call_and_a_call_within_it_keeps_them(
    spinner, signals_sent, monkeypatch
):
    # The caller's own work with the answer goes first (worker_pause.GRACE).
    monkeypatch.setattr(worker_pause, "GRACE", 0.2)  # long enough to start a call within it
    PAUSE.busy(spinner)
    try:
        with PACER.serving():
            _becomes(spinner, "T", "the spinner is stopped in the call", 1.0)
        with PACER.serving():  # within the grace: still stopped, no continue went out
            assert _state(spinner) == "T"
        ended = time.perf_counter()
        _becomes(spinner, "R", "the spinner runs again")
    finally:
        PAUSE.idle(spinner)
    continues = [at for sig, _, at in signals_sent if sig == signal.SIGCONT]
    assert [sig for sig, *_ in signals_sent].count(signal.SIGSTOP) == 1, "the second call kept them stopped"
    assert len(continues) == 1 and continues[0] - ended >= 0.2 * 0.9, (continues, ended)


@linux_only
def test_a_worker_let_go_in_the_grace_is_stopped_again_by_the_next_call(spinner, monkeypatch):
    # Its continue was still to go out (the grace) when it went idle, which continued it: the
    # next call, once it is busy again, must stop it, not take it for stopped still.
    monkeypatch.setattr(worker_pause, "GRACE", 0.5)
    PAUSE.busy(spinner)
    try:
        with PACER.serving():
            _becomes(spinner, "T", "the spinner is stopped in the call", 1.0)
        PAUSE.idle(spinner)  # within the grace
        _becomes(spinner, "R", "the idle spinner runs", 1.0)
        PAUSE.busy(spinner)
        with PACER.serving():
            _becomes(spinner, "T", "the spinner is stopped in the next call", 1.0)
    finally:
        PAUSE.idle(spinner)
    _becomes(spinner, "R", "the spinner runs once it is idle")


def _steady_stream(calls: int) -> None:
    """A 2 ms call every 30 ms, ``calls`` of them, ending as the last call ends."""
    for call in range(calls):
        if call:
            time.sleep(0.028)
        with PACER.serving():
            time.sleep(0.002)


@linux_only
@pytest.mark.timing  # the continuing thread must wake within the window's 3 ms
def test_busy_workers_are_stopped_before_a_steady_streams_next_call_and_run_if_it_does_not_come(
    spinner, signals_sent
):
    PAUSE.busy(spinner)
    try:
        _steady_stream(12)
        start, until = PACER.arrivals.window
        assert start < until < start + 0.01, (start, until)
        sent_before = len(signals_sent)
        time.sleep(until - time.perf_counter() + 0.02)  # no call comes
        late = [(sig, at) for sig, _, at in signals_sent[sent_before:]]
        # Continued after the last call, stopped in the window, continued once it passed.
        kinds = [sig for sig, _ in late]
        assert kinds[-2:] == [signal.SIGSTOP, signal.SIGCONT], late
        stopped_at, continued_at = late[-2][1], late[-1][1]
        assert start - 0.001 <= stopped_at < until <= continued_at, (start, until, late)
        _becomes(spinner, "R", "the spinner runs again")
    finally:
        PAUSE.idle(spinner)


@linux_only
@pytest.mark.timing  # the continuing thread must wake within the window's 3 ms
def test_a_call_that_comes_as_predicted_finds_the_workers_stopped_ahead_of_it(spinner, signals_sent):
    PAUSE.busy(spinner)
    try:
        _steady_stream(12)
        start, _ = PACER.arrivals.window
        time.sleep(start - time.perf_counter() + 0.0015)  # the call comes 0.5 ms before it is due
        caller = threading.get_ident()
        sent_before = len(signals_sent)
        with PACER.serving():
            assert PAUSE.stopped() == [spinner]
            assert _state(spinner) == "T"
            # The calling thread sent no SIGSTOP: the worker was stopped before it.
            assert [s for s, thread, _ in signals_sent[sent_before:] if thread == caller] == []
    finally:
        PAUSE.idle(spinner)


@linux_only
def test_a_served_call_that_waits_on_the_workers_lets_them_run(spinner):
    PAUSE.busy(spinner)
    try:
        with PACER.serving():
            _becomes(spinner, "T", "the spinner is stopped in the call", 1.0)
            unblock_workers()  # what WorkerFanOut.take_replies does before it blocks
            _becomes(spinner, "R", "the worker runs inside the call that waits on it")
            with PACER.serving():  # a nested call does not stop it again
                assert _state(spinner) == "R"
        with PACER.serving():  # the next call does
            _becomes(spinner, "T", "the spinner is stopped in the next call", 1.0)
    finally:
        PAUSE.idle(spinner)
    _becomes(spinner, "R", "the spinner runs once it is idle")


@linux_only
def test_a_served_call_that_outlasts_the_look_lets_the_workers_run(spinner, monkeypatch):
    # A call waiting on something a stopped worker holds (a lock of the cache's) would never end.
    monkeypatch.setattr(worker_pause, "_LOOK", 0.05)
    PAUSE.busy(spinner)
    try:
        with PACER.serving():
            _becomes(spinner, "T", "the spinner is stopped in the call", 1.0)
            _becomes(spinner, "R", "the continuing thread lets it run in the call")
    finally:
        PAUSE.idle(spinner)


@linux_only
def test_outside_a_served_call_waiting_on_the_workers_changes_nothing(spinner):
    PAUSE.busy(spinner)
    try:
        stops = PAUSE.stops
        unblock_workers()
        with PACER.serving():
            assert PAUSE.stopped() == [spinner]
        assert PAUSE.stops == stops + 1
    finally:
        PAUSE.idle(spinner)


@linux_only
def test_a_stopped_worker_whose_parent_dies_ends(tmp_path):
    parent = textwrap.dedent(
        f"""
        import os, signal, subprocess, sys, time
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup: passed on to what it starts
        child = subprocess.Popen([sys.executable, "-c", {SPIN!r}])
        while os.getpgid(child.pid) != child.pid:
            time.sleep(0.01)
        os.killpg(child.pid, signal.SIGSTOP)
        print(child.pid, flush=True)
        time.sleep(600)
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", parent],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert process.stdout is not None
    child = int(process.stdout.readline())
    try:
        _becomes(child, "T", "the child is stopped")
        process.kill()  # no atexit, no handler: as an OOM kill or a crash ends a server
        process.wait()
        # Its group lost its last parent in the session while stopped: SIGHUP, then SIGCONT, end it.
        _until(lambda: _state(child) in ("", "Z"), "the orphaned stopped worker ended", timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):  # not left spinning when the test fails
            os.kill(child, signal.SIGKILL)


@linux_only
def test_a_starting_pool_worker_is_stopped_while_a_call_is_served():
    pool = CompilePool(1)
    try:
        pool.start()  # importing torch and Inductor: seconds of work
        worker = pool.workers[0]
        assert worker.process is not None
        pid = worker.process.pid
        with PACER.serving():
            assert PAUSE.stopped() == [pid]
            _becomes(pid, "T", "the starting worker is stopped in the call", 1.0)
        assert worker.started_up.wait(180) and worker.start_problem is None
        with PACER.serving():  # started, waiting for a job: nothing to stop
            assert PAUSE.stopped() == []
    finally:
        pool.stop()
    # Ended (told to, or killed after 10 s: at SCHED_IDLE on a machine whose cores the test suite
    # keeps busy, its exit can wait that long for a core).
    assert worker.process.poll() is not None


@linux_only
def test_a_worker_given_up_on_is_killed_with_the_compiler_it_started():
    # A worker stuck in a C++ compile that never ends is killed after JOB_SECONDS: the compiler too.
    worker = textwrap.dedent(
        """
        import subprocess, sys
        from tessera.compile_worker import _own_group
        _own_group()
        compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(compiler.pid, flush=True)
        compiler.wait()
        """
    )
    process = subprocess.Popen(
        [sys.executable, "-c", worker], stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()}
    )
    assert process.stdout is not None
    compiler = int(process.stdout.readline())
    try:
        CompilePool(0).kill(process)
        assert process.returncode == -signal.SIGKILL
        _until(lambda: _state(compiler) in ("", "Z"), "the worker's compiler ended")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(compiler, signal.SIGKILL)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def made_up(monkeypatch) -> tuple[WorkerPause, _Clock, list[tuple[int, int]]]:
    """A pause of its own on a made-up clock, whose signals are recorded, not sent."""
    clock, sent = _Clock(), []

    def record(pid, sig, hold_gil=True):
        sent.append((pid, sig))
        return True

    monkeypatch.setattr(worker_pause, "time", clock)
    monkeypatch.setattr(worker_pause, "_signal", record)
    monkeypatch.setattr(worker_pause, "_LOOK", 1e6)  # the continuing thread's looks: not in these
    pause = WorkerPause()
    pause.busy(7)
    return pause, clock, sent


TYPICAL = 0.25  # seconds, exact in binary: the made-up clock adds it up without rounding
WAIT, STARVED = 3 * TYPICAL, 6 * TYPICAL


def _stream(pause: WorkerPause, clock: _Clock, calls: int, gap: float, length: float = TYPICAL) -> list[bool]:
    """Serve ``calls`` calls one after the other: whether the worker was stopped for each."""
    stopped = []
    for _ in range(calls):
        pause.call_started(1, WAIT, STARVED, TYPICAL)
        stopped.append(bool(pause.stopped()))
        clock.now += length
        pause.call_ended(0, WAIT)
        clock.now += gap
    return stopped


def test_with_a_typical_calls_gap_between_calls_every_call_stops_the_workers(made_up):
    pause, clock, _ = made_up
    assert _stream(pause, clock, 50, gap=TYPICAL) == [True] * 50


def test_with_no_gap_between_calls_one_call_in_seven_runs_beside_the_workers(made_up):
    pause, clock, _ = made_up
    stopped = _stream(pause, clock, 70, gap=0.0)
    # Six typical calls stopped, then the seventh runs beside them, and the count starts again.
    assert stopped == ([True] * 6 + [False]) * 10


def test_overlapping_calls_keep_the_workers_stopped_at_most_the_wait(made_up):
    pause, clock, _ = made_up
    pause.call_started(1, WAIT, STARVED, TYPICAL)
    assert pause.stopped() == [7]
    clock.now += WAIT / 2
    pause.call_started(2, WAIT, STARVED, TYPICAL)  # a second thread's call: within the wait
    assert pause.stopped() == [7]
    clock.now += WAIT
    pause.call_ended(1, WAIT)  # the first ends, the second still runs: the wait is over
    assert pause.stopped() == []
    pause.call_started(2, WAIT, STARVED, TYPICAL)  # and they run until no call is served
    assert pause.stopped() == []
    pause.call_ended(1, WAIT)
    pause.call_ended(0, WAIT)
    clock.now += TYPICAL
    pause.call_started(1, WAIT, STARVED, TYPICAL)
    assert pause.stopped() == [7]


def test_a_continue_not_sent_yet_when_the_next_call_starts_leaves_the_workers_stopped(made_up, monkeypatch):
    pause, clock, sent = made_up
    monkeypatch.setattr(pause, "_continue_asked", lambda: None)  # the continuing thread never gets to it
    pause.call_started(1, WAIT, STARVED, TYPICAL)
    clock.now += TYPICAL
    pause.call_ended(0, WAIT)
    assert pause.stopped() == []
    pause.call_started(1, WAIT, STARVED, TYPICAL)
    assert pause.stopped() == [7]
    assert sent == [(7, signal.SIGSTOP)]  # one SIGSTOP, no SIGCONT: the second call found it stopped


def test_a_continue_that_fails_is_tried_again(made_up, monkeypatch, caplog):
    pause, clock, sent = made_up
    monkeypatch.setattr(worker_pause, "_LOOK", 0.01)
    failures = [RuntimeError("a signal that failed")]

    def once_failing(pid, sig, hold_gil=True):
        if sig == signal.SIGCONT and failures:
            raise failures.pop()
        sent.append((pid, sig))
        return True

    monkeypatch.setattr(worker_pause, "_signal", once_failing)
    pause.call_started(1, WAIT, STARVED, TYPICAL)
    clock.now += TYPICAL
    pause.call_ended(0, WAIT)
    _until(lambda: (7, signal.SIGCONT) in sent, "the worker is continued after the failure")
    assert "continuing the compile workers failed" in caplog.text


def test_workers_stopped_ahead_of_a_call_stay_stopped_for_it_and_run_again_if_it_does_not_come(made_up):
    pause, clock, sent = made_up
    stop = signal.SIGSTOP
    window = (clock.now + 0.010, clock.now + 0.013)
    pause.call_ended(0, WAIT, window)
    with pause._lock:
        assert pause._ahead_of_call(clock.now) == pytest.approx(0.010)  # not yet
        clock.now = window[0]
        pause._ahead_of_call(clock.now)  # the continuing thread, at the window's start
    assert sent == [] and pause.stopped() == [7]  # taken for stopped; the signal goes out unlocked
    pause._send_stops()
    assert sent == [(7, stop)] and pause.stopped() == [7]
    clock.now += 0.001
    pause.call_started(1, WAIT, STARVED, TYPICAL)  # the call comes: no second SIGSTOP
    assert sent == [(7, stop)] and pause.stopped() == [7]
    clock.now += TYPICAL
    pause.call_ended(0, WAIT)
    assert pause.stopped() == []
    with pause._lock:  # what the continuing thread does a grace later: the SIGCONT is sent
        assert pause._to_continue == [7]
        pause._to_continue.clear()

    sent.clear()
    window = (clock.now + 0.010, clock.now + 0.013)
    pause.call_ended(0, WAIT, window)
    with pause._lock:
        clock.now = window[0]
        pause._ahead_of_call(clock.now)
        assert pause._stopped == [7]
        clock.now = window[1]
        assert pause._ahead_of_call(clock.now) == 0.0  # the call did not come: they run again
        assert pause._stopped == [] and pause._to_continue == [7] and not pause._ahead


def test_a_worker_forgotten_before_its_stop_ahead_went_out_is_continued_after_it(made_up):
    pause, clock, sent = made_up
    window = (clock.now + 0.010, clock.now + 0.013)
    pause.call_ended(0, WAIT, window)
    clock.now = window[0]
    with pause._lock:
        pause._ahead_of_call(clock.now)
        pids = list(pause._to_stop)
    pause.forget(7)  # its job ended: continued (it was taken for stopped)
    assert pause.stopped() == [] and pause._to_stop == []
    pause.busy(7)  # and its next job began
    sent.clear()
    pause._to_stop = pids  # as if the continuing thread had taken them before the forget
    pause._send_stops()
    assert sent == [(7, signal.SIGSTOP), (7, signal.SIGCONT)]  # not left stopped, untracked


def test_a_worker_forgotten_before_its_stop_again_went_out_is_continued_after_it(made_up, monkeypatch):
    # The continuing thread's SIGCONT met a call that had started: the worker is stopped again for
    # it, outside the lock; a forget in between must not leave it stopped for good.
    pause, clock, sent = made_up
    real_signal = worker_pause._signal

    events = ["call", "forget"]

    def forget_before_the_restop(pid, sig, hold_gil=True):
        if sig == signal.SIGSTOP and not hold_gil and events[:1] == ["forget"]:
            events.pop(0)  # before the continuing thread's re-stop: the job ends, the next begins
            pause.forget(pid)
            pause.busy(pid)
        sent_now = real_signal(pid, sig, hold_gil)
        if sig == signal.SIGCONT and events[:1] == ["call"]:
            events.pop(0)
            pause.call_started(1, WAIT, STARVED, TYPICAL)  # a call starts as the SIGCONT goes out
        return sent_now

    monkeypatch.setattr(pause, "_continue_asked", lambda: None)  # this test runs its rounds
    pause.call_started(1, WAIT, STARVED, TYPICAL)
    clock.now += TYPICAL
    pause.call_ended(0, WAIT)
    clock.now += 1.0  # past the grace
    monkeypatch.setattr(worker_pause, "_signal", forget_before_the_restop)
    sent.clear()
    pause._continue_once()
    assert events == []  # both happened
    assert sent[-1] == (7, signal.SIGCONT) and pause.stopped() == []  # not left stopped, untracked


def test_a_stopped_worker_forgotten_is_continued_without_the_gil(made_up, monkeypatch):
    # Forgotten by the pool's thread as a job ends, beside the calls served: a continued compiler
    # can take that thread's core inside the system call, which must not hold the GIL then.
    pause, _, _ = made_up
    sent = []

    def record(pid: int, sig: signal.Signals, hold_gil: bool = True) -> bool:
        sent.append((sig, hold_gil))
        return True

    monkeypatch.setattr(worker_pause, "_signal", record)
    pause.call_started(1, WAIT, STARVED, TYPICAL)
    pause.forget(7)
    assert sent == [(signal.SIGSTOP, True), (signal.SIGCONT, False)]


def test_no_worker_is_stopped_ahead_while_a_call_waits_on_them_nor_after_a_call_came(made_up):
    pause, clock, sent = made_up
    window = (clock.now + 0.010, clock.now + 0.013)
    pause.call_ended(0, WAIT, window)
    clock.now = window[0] + 0.001
    pause.call_started(1, WAIT, STARVED, TYPICAL)
    sent.clear()
    pause.unblock()  # the call waits on a worker
    with pause._lock:
        assert pause._ahead_of_call(clock.now) == math.inf
    assert (7, signal.SIGSTOP) not in sent
