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

import atexit
import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

from tessera import counters
from tessera.compile_jobs import READY, JobDone, JobFailed, PieceJob, read_message, write_message
from tessera.compile_state import COMPILE_LOCK
from tessera.config import SizeRange, size_label
from tessera.errors import CompilerError

if TYPE_CHECKING:
    from tessera.artifact_cache import ArtifactCache, CompileOutcome
    from tessera.compile_state import CompileState
    from tessera.compilers import CompilesInWorkers
    from tessera.config import CompileConfig
    from tessera.work import Job

log = logging.getLogger(__name__)

MAX_WORKERS = 8
# How long a new worker may take to import torch and Inductor before it is given up on.
START_SECONDS = 180.0
# How long a job may go unanswered before its worker is taken for hung (a compiler stuck in a
# deadlock, a C++ compile that never ends): the worker is stopped, the piece compiled by the caller,
# and a new worker takes the next job. One piece at one size compiles in seconds to minutes.
JOB_SECONDS = 1800.0


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
        self.ready = False  # the process said READY
        self.starting = threading.Lock()  # the pool's start and this thread's first job race

    def ensure_process(self) -> None:
        """Start the worker process unless it runs (one that died is replaced)."""
        with self.starting:
            if self.process is None or self.process.poll() is not None:
                self.start_process()

    def start_process(self) -> None:
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from tessera.compile_worker import main; main()"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self.pool.env,
            )
            counters.bump("compile_workers_started")
        except OSError as e:
            log.warning("cannot start a compile worker (%s); compiling in this process", e)
            self.process = None
        self.ready = False

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
            self.ready = True
            return None
        process.kill()
        process.wait()
        if not readable:
            return f"compile worker {process.pid} did not start within {START_SECONDS:.0f}s"
        return f"compile worker {process.pid} did not start (exit status {process.returncode})"

    def run(self) -> None:
        while True:
            payload, tag, replies = self.pool.jobs.get()
            # The worker takes a core while the job runs: the calls served as traced leave it one.
            with self.pool.compiling():
                result = self.serve(payload)
            replies.put(Reply(tag, result))

    def serve(self, payload: bytes) -> JobDone | JobFailed:
        self.ensure_process()  # started by the pool, or now; one that died is replaced
        process = self.process
        if process is None:
            return JobFailed("no compile worker could be started")
        if not self.ready:
            problem = self._wait_ready(process)
            if problem is not None:
                return JobFailed(problem)
        stdin: IO[bytes] | None = process.stdin
        stdout: IO[bytes] | None = process.stdout
        assert stdin is not None and stdout is not None
        try:
            write_message(stdin, payload)
            answered, _, _ = select.select([stdout], [], [], JOB_SECONDS)
            if not answered:
                process.kill()
                process.wait()
                return JobFailed(
                    f"compile worker {process.pid} did not finish its job within {JOB_SECONDS:.0f}s "
                    "and was stopped"
                )
            result = read_message(stdout)
        except Exception as e:  # the pipe broke, or the answer is not one: the worker is replaced
            result = None
            log.debug("compile worker %d: %s: %s", process.pid, type(e).__name__, e)
        if not isinstance(result, (JobDone, JobFailed)):
            process.kill()
            process.wait()
            return JobFailed(f"compile worker {process.pid} exited with status {process.returncode}")
        return result

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()  # the worker's loop ends at the end of its stdin
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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

    def compiling(self) -> contextlib.AbstractContextManager[None]:
        """Counts a job's run as a compile beside the served calls (pacing.py); not at "normal"
        priority, where nothing gives way on the cores."""
        if self.priority == "normal":
            return contextlib.nullcontext()
        from tessera.pacing import PACER

        return PACER.compiling()

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


def _worker_env(count: int, priority: str) -> dict[str, str]:
    env = dict(os.environ)
    # Each worker lowers its own CPU priority as it starts (priority.py): it competes with the
    # calls this process serves, as a background compile thread does.
    env["TESSERA_BACKGROUND_PRIORITY"] = priority
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
            # atexit runs after the interpreter joined the background compile threads (non-daemon),
            # so no job is in flight when the workers are told to stop.
            atexit.register(pool.stop)
        return pool


@dataclass(frozen=True)
class _Sent:
    """The tag a job's reply carries: the job, its artifact's key, when it was submitted."""

    job: Job
    key: str
    submitted: float


class WorkerFanOut:
    """One compile round's static sizes, handed to the compile workers, and their artifacts
    installed (``install``) as the replies come in.

    Identical pieces (transformer layers) send one job: the others take its artifact as shared
    once it is in, as they would from a compile here, so the entry is the same. A job the workers
    cannot take is compiled by the caller (``send`` says False); one that failed in a worker is
    compiled here, and ``on_failure`` told."""

    def __init__(
        self,
        pool: CompilePool,
        compiler: CompilesInWorkers,
        artifact_cache: ArtifactCache,
        config: CompileConfig,
        state: CompileState,
        install: Callable[[Job, CompileOutcome], None],
        on_failure: Callable[[Job, str], None],
    ) -> None:
        self.pool = pool
        self.compiler = compiler
        self.artifact_cache = artifact_cache
        self.config = config
        self.state = state
        self.install = install
        self.on_failure = on_failure
        self.replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        self.leaders: dict[str, Job] = {}  # artifact key -> the job that compiles it
        self.followers: dict[str, list[Job]] = {}  # artifact key -> identical pieces' jobs
        self.waiting = 0  # jobs sent whose reply is not in yet

    def send(self, job: Job) -> bool:
        """Hand ``job`` to the workers; False when the caller must compile it (a range, or the
        workers cannot take it)."""
        size, item = job.size, job.work.item
        if isinstance(size, SizeRange):
            return False
        key = self.artifact_cache.content_key(job.work.content, size)
        if key in self.leaders:
            self.followers.setdefault(key, []).append(job)
            return True
        with COMPILE_LOCK:
            counters.bump("backend_compilations")  # as ArtifactCache.get counts each artifact asked for
            found = self.artifact_cache.find(item.graph, size, item.index, key)
            if found is not None:  # in the cache already: no compile at all
                self.install(job, found)
                return True
            scratch = self.artifact_cache.scratch_name(size, item.index)
            piece_job = self.compiler.job(item.graph, job.work.inputs(size)(), self.config, size, scratch)
        if piece_job is not None:
            piece_job = dataclasses.replace(piece_job, state=self.state)
        if piece_job is None or not self.pool.submit(
            piece_job, _Sent(job, key, time.perf_counter()), self.replies
        ):
            return False
        self.leaders[key] = job
        self.waiting += 1
        return True

    def take_replies(self, block: bool) -> None:
        """Install what the workers finished (waiting for one reply when ``block``)."""
        while self.waiting:
            try:
                reply = self.replies.get(block=block)
            except queue.Empty:
                return
            self.waiting -= 1
            block = False
            sent: _Sent = reply.tag
            job, item = sent.job, sent.job.work.item
            with COMPILE_LOCK:
                outcome = self._outcome(reply, job, sent.key)
                if outcome is None:  # the worker failed: compiled here after all
                    outcome = self.artifact_cache.compile(
                        item.graph, job.work.inputs(job.size), job.size, item.index, sent.key
                    )
                self.install(job, outcome)
                for twin in self.followers.pop(sent.key, []):
                    shared = self.artifact_cache.get(
                        twin.work.item.graph, _no_inputs, twin.size, twin.work.item.index, sent.key
                    )
                    self.install(twin, shared)
            log.debug(
                "%s (%s) from a compile worker after %.2fs",
                item.name,
                job.size,
                time.perf_counter() - sent.submitted,
            )

    def finish(self) -> None:
        """Wait for every job sent, installing each."""
        while self.waiting:
            self.take_replies(block=True)

    def _outcome(self, reply: Reply, job: Job, key: str) -> CompileOutcome | None:
        """The artifact a worker compiled, recorded in the entry; None if the worker failed (the
        piece is then compiled here: a worker never makes a compile fail)."""
        done = reply.result
        if isinstance(done, JobDone):
            try:
                fn, handle = self.compiler.finish(done)
            except CompilerError as e:
                done = JobFailed(str(e))
            else:
                assert not isinstance(job.size, SizeRange), "ranges are never sent"
                return self.artifact_cache.record_compiled(
                    fn, handle, job.size, job.work.item.index, key, done.seconds, worker=done.pid
                )
        self.on_failure(job, done.error)
        return None


def _no_inputs() -> Sequence[Any]:
    return ()  # an identical piece's artifact is in the cache by then: nothing is compiled


class FanOutOwner(Protocol):
    """What a fan-out is made from: a model's pieces (split_model.SplitModel)."""

    pool: CompilePool | None
    compiler: Any
    artifact_cache: ArtifactCache
    config: CompileConfig
    state: CompileState


def workers_for(owner: FanOutOwner, graph_pool: object, general: bool) -> CompilePool | None:
    """The process's compile workers for ``owner``'s compiles (started at the first use), or None
    where they cannot take them: ``compile_workers=0``, a compiler that does not compile in workers,
    no cache entry (a worker's artifact reaches this process through it), or CUDA graphs
    (``graph_pool``: a capture needs every size at install). ``compile_workers`` unset:
    ``default_count(general)``."""
    from tessera.compilers import CompilesInWorkers

    if graph_pool is not None or not isinstance(owner.compiler, CompilesInWorkers):
        return None
    if owner.artifact_cache.entry is None:
        return None
    count = owner.config.compile_workers
    return shared_pool(
        default_count(general=general) if count is None else count, owner.config.background_priority
    )


def worker_fan_out(
    owner: FanOutOwner,
    install: Callable[[Job, CompileOutcome], None],
    on_failure: Callable[[Job, str], None],
) -> WorkerFanOut | None:
    """A fan-out of ``owner``'s compiles to its workers; None when it has none, or a compiler
    that cannot use them."""
    from tessera.compilers import CompilesInWorkers

    if owner.pool is None or not isinstance(owner.compiler, CompilesInWorkers):
        return None
    return WorkerFanOut(
        owner.pool, owner.compiler, owner.artifact_cache, owner.config, owner.state, install, on_failure
    )


def obtain_all(jobs: Sequence[Job], fan_out: WorkerFanOut | None, here: Callable[[Job], None]) -> None:
    """Every job obtained: sent to the workers where they take it (at once: they compile there
    while the rest compile here), the others by ``here`` in order, the workers' artifacts installed
    as they come in; returns when every one is in."""
    kept = [job for job in jobs if fan_out is None or not fan_out.send(job)]
    for job in kept:
        here(job)
        if fan_out is not None:
            fan_out.take_replies(block=False)
    if fan_out is not None:
        fan_out.finish()


def warn_once(prefix: str) -> Callable[[Job, str], None]:
    """A fan-out's ``on_failure`` for one model (``prefix``): the first worker failure is warned
    (the piece is compiled here instead), the others only logged."""
    said = False

    def failed(job: Job, error: str) -> None:
        nonlocal said

        level = logging.DEBUG if said else logging.WARNING
        said = True
        log.log(
            level,
            "%s: a compile worker failed on %s (%s: %s); compiling here instead",
            prefix,
            job.work.item.name,
            size_label(job.size),
            error,
        )

    return failed
