"""Compile workers for this process: distinct pieces compiled at once on the machine's cores.

Inductor's compile is Python (lowering, scheduling, code generation) under the GIL, and its
configuration is global, so two compiles in one process neither overlap nor stay apart
(``backend.COMPILE_LOCK``). Processes do both. Each worker (``compile_worker.py``) is started once,
when the first model that needs it finds an artifact missing from its cache (a warm start starts
none), and serves every later model of the process; it runs Inductor's own kernel compiles with
its share of the cores.

Static sizes and shapes (listed or learnt from traffic) and general ones go to a worker (see
compile_jobs.py): a compile there keeps this process's GIL free for the calls it serves meanwhile
(Inductor's lowering and code generation hold it in long C calls that no pacing interrupts). A job
a worker cannot take (its graph does not pickle, the worker died, raised or hung) is answered
``JobFailed`` and compiled by the caller in its own process: a worker can make a compile faster,
never make one fail.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tessera import counters
from tessera.compilation.background import at_close
from tessera.compilation.compile_jobs import READY, JobDone, JobFailed, PieceJob, read_message, write_message

log = logging.getLogger(__name__)

MAX_WORKERS = 8
# How long a new worker may take to import torch and Inductor before it is given up on.
START_SECONDS = 180.0
# How long a job may go unanswered before its worker is taken for hung (a compiler stuck in a
# deadlock, a C++ compile that never ends): the worker is stopped, the piece compiled by the caller,
# and a new worker takes the next job. One piece at one size compiles in seconds to minutes.
JOB_SECONDS = 1800.0
# How long the workers, told to stop, may take to end, all together, before they are killed.
STOP_SECONDS = 10.0


def default_count(general: bool = False) -> int:
    """Workers when ``compile_workers`` is not set: two cores for this process (tracing, serving
    as traced, the general compiles) and Inductor's kernel compiles, then one worker per two
    cores (its Python and its kernel compiles), up to ``MAX_WORKERS``. None on two cores for
    static sizes alone: measured there, one worker made an up-front cold compile slower (its start
    competes with the general compiles), see benchmarks/cold_start.py. At least one where the
    general compiles can go to it (``general``: in the background, while the pieces serve): a
    general compile here holds the GIL that the served calls need, in C calls no pacing
    interrupts (benchmarks/first_minute.py, docs/serving.md)."""
    count = max(0, min(MAX_WORKERS, ((os.cpu_count() or 2) - 2) // 2))
    return max(count, 1) if general else count


@dataclass(frozen=True)
class Reply:
    """What became of one submitted job: ``tag`` is the caller's, ``result`` the worker's answer."""

    tag: Any
    result: JobDone | JobFailed


class _Worker(threading.Thread):
    """One worker process and the thread that feeds it jobs, one at a time, from the pool's queue."""

    def __init__(self, pool: CompilePool, number: int) -> None:
        super().__init__(name=f"tessera-compile-worker-{number}", daemon=True)
        self.pool = pool
        self.process: subprocess.Popen[bytes] | None = None
        self.start_problem: str | None = None  # why it did not (it was then stopped)
        self.started_up = threading.Event()  # set once it said READY or was given up on
        self.starting = threading.Lock()  # the pool's start and this thread's first job race

    def ensure_process(self) -> None:
        """Start the worker process unless it runs (one that died is replaced)."""
        with self.starting:
            if self.pool.closed:
                return
            if self.process is None or self.process.poll() is not None:
                self.start_process()

    def start_process(self) -> None:
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", "from tessera.compilation.compile_worker import main; main()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self.pool.env,
            )
            counters.bump("compile_workers_started")
        except OSError as e:
            log.warning("cannot start a compile worker (%s); compiling in this process", e)
            self.process = None
            return
        self.process, self.start_problem = process, None
        self.started_up = started_up = threading.Event()
        waiter = threading.Thread(
            target=self._await_start, args=(process, started_up), name=f"{self.name}-start", daemon=True
        )
        waiter.start()

    def _await_start(self, process: subprocess.Popen[bytes], started_up: threading.Event) -> None:
        try:
            self.start_problem = self._wait_ready(process)
        finally:
            started_up.set()

    def _wait_ready(self, process: subprocess.Popen[bytes]) -> str | None:
        """None once the worker said READY; else why not (it is then stopped)."""
        stdout = process.stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], START_SECONDS)
        try:
            said = read_message(stdout) if readable else None
        except Exception as e:  # not a message: something else wrote to the result stream
            said = None
            log.debug("compile worker %d: %s: %s", process.pid, type(e).__name__, e)
        if said == READY:
            return None
        self.pool.kill(process)
        if not readable:
            return f"compile worker {process.pid} did not start within {START_SECONDS:.0f}s"
        return f"compile worker {process.pid} did not start (exit status {process.returncode})"

    def run(self) -> None:
        while True:
            payload, tag, replies = self.pool.jobs.get()
            result = self.serve(payload)
            replies.put(Reply(tag, result))

    def serve(self, payload: bytes) -> JobFailed | JobDone:
        self.ensure_process()  # started by the pool, or now; one that died is replaced
        process = self.process
        if process is None:
            return JobFailed("no compile worker could be started")
        self.started_up.wait()
        if self.start_problem is not None:
            return JobFailed(self.start_problem)
        return self._job(process, payload)

    def _job(self, process: subprocess.Popen[bytes], payload: bytes) -> JobDone | JobFailed:
        stdin: IO[bytes] | None = process.stdin
        stdout: IO[bytes] | None = process.stdout
        assert stdin is not None and stdout is not None
        try:
            write_message(stdin, payload)
            answered, _, _ = select.select([stdout], [], [], JOB_SECONDS)
            if not answered:
                self.pool.kill(process)
                return JobFailed(
                    f"compile worker {process.pid} did not finish its job within {JOB_SECONDS:.0f}s "
                    "and was stopped"
                )
            result = read_message(stdout)
        except Exception as e:  # the pipe broke, or the answer is not one: the worker is replaced
            result = None
            log.debug("compile worker %d: %s: %s", process.pid, type(e).__name__, e)
        if not isinstance(result, (JobDone, JobFailed)):
            self.pool.kill(process)
            return JobFailed(f"compile worker {process.pid} exited with status {process.returncode}")
        return result

    def tell_to_stop(self) -> None:
        """Close the worker's stdin: its loop ends there (``wait_stopped`` waits for it)."""
        process = self.process
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()

    def wait_stopped(self, deadline: float) -> None:
        """Wait until ``deadline`` (``time.monotonic``) for the worker to end, then kill it: it has
        no job by then, and its artifacts are in the cache."""
        process = self.process
        if process is None:
            return
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.pool.kill(process)


class CompilePool:
    """Worker processes, started (``start``) when something is to compile, or at the first job,
    and kept until this process exits: a warm start that loads every artifact starts none."""

    def __init__(self, count: int, priority: str = "low") -> None:
        self.count = count
        self.jobs: queue.SimpleQueue[tuple[bytes, Any, queue.SimpleQueue[Reply]]] = queue.SimpleQueue()
        self.env = _worker_env(count, priority)
        self.priority = priority
        self.workers = [_Worker(self, n) for n in range(count)]
        self.started = False
        self.closed = False  # ended as the process exits: no worker is started again
        for worker in self.workers:
            worker.start()  # the feeding threads; the processes wait for start() or a job

    def start(self) -> None:
        """Start the worker processes now, so that they import torch and Inductor while this
        process compiles what it compiles first (idempotent)."""
        if self.started:
            return
        self.started = True
        for worker in self.workers:
            worker.ensure_process()

    def submit(self, job: PieceJob, tag: Any, replies: queue.SimpleQueue[Reply]) -> bool:
        """Queue ``job``; its ``Reply`` arrives on ``replies``. False (nothing queued) when the job
        does not pickle: the caller compiles it itself."""
        try:
            payload = pickle.dumps(job)
        except Exception as e:  # a graph holding something unpicklable (a custom op's closure)
            log.debug("piece job at size %s does not pickle (%s: %s)", job.size, type(e).__name__, e)
            return False
        self.jobs.put((payload, tag, replies))
        return True

    def kill(self, process: subprocess.Popen[bytes]) -> None:
        """End a worker given up on, and the compilers it started (it is then replaced at the next
        job)."""
        if process.poll() is None and not _kill_group(process.pid):
            process.kill()
        with contextlib.suppress(OSError):
            process.wait()

    def stop(self) -> None:
        """End every worker: all told at once, then up to STOP_SECONDS for all of them together (a
        worker at SCHED_IDLE on a machine kept busy can wait that long for a core to exit in)."""
        for worker in self.workers:
            worker.tell_to_stop()
        deadline = time.monotonic() + STOP_SECONDS
        for worker in self.workers:
            worker.wait_stopped(deadline)

    def end_now(self) -> None:
        """End every worker at once, and the compilers it started: the process exits, and what
        they compile would reach nothing (the next process compiles what is missing)."""
        self.closed = True
        for worker in self.workers:
            process = worker.process
            if process is not None:
                self.kill(process)


def _kill_group(pid: int) -> bool:
    """SIGKILL worker ``pid`` with the compilers it started (its process group, compile_worker.py);
    False where there is no process group to signal."""
    sig = getattr(signal, "SIGKILL", None)
    if sig is None or not hasattr(os, "killpg"):
        return False
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):  # gone already, or not its own group
        return False
    return True


def _worker_env(count: int, priority: str) -> dict[str, str]:
    env = dict(os.environ)
    # Each worker lowers its own CPU priority as it starts (priority.py): it competes with the
    # calls this process serves. This process's threads keep theirs.
    env["TESSERA_BACKGROUND_PRIORITY"] = priority
    env["TESSERA_PARENT_PID"] = str(os.getpid())  # the worker ends when this process is gone
    # The worker imports this very tessera, installed or not.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    # Inductor's kernel compiles in each worker share the cores with the others and the parent;
    # one thread compiles in-process (no pool of its own to start).
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 2) // (count + 1))))
    return env


_pools: dict[str, CompilePool] = {}  # the one pool of this process, under "shared"
_pool_lock = threading.Lock()
# A forked child (a server's preloaded workers) has the parent's pool object but none of its
# threads: it starts a pool of its own when it needs one.
os.register_at_fork(after_in_child=_pools.clear)


def shared_pool(count: int, priority: str = "low") -> CompilePool | None:
    """This process's pool, started with ``count`` workers at ``priority`` (priority.py) on first
    use; None when ``count`` is 0. Later calls get the same pool whatever they ask for."""
    if count <= 0:
        return None
    with _pool_lock:
        pool = _pools.get("shared")
        if pool is None:
            pool = _pools["shared"] = CompilePool(count, priority)
            # As the process begins to exit, before its threads are joined (background.py): the
            # background compiles then stop waiting on the workers.
            at_close(pool.end_now)
        return pool
