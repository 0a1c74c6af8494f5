"""One compile round's jobs handed to the compile workers (compile_pool.py), their artifacts
installed as the replies come in, and what the workers cannot take compiled by the caller.

Split from the pool: the pool is the processes and how a job reaches one; this is what a round of
a model's compiles (schedule.py, size_learning.py) does with them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tessera import _compat, counters
from tessera.compilation import compile_pool
from tessera.compilation.background import CLOSING, check_open
from tessera.compilation.compile_jobs import JobDone, JobFailed
from tessera.compilation.compile_pool import CompilePool, Reply
from tessera.compilation.compile_state import COMPILE_LOCK
from tessera.config import SizeRange, size_label
from tessera.errors import CompilerError

if TYPE_CHECKING:
    from tessera.compilation.artifact_cache import ArtifactCache, CompileOutcome
    from tessera.compilation.compile_state import CompileState
    from tessera.compilation.compilers import CompilesInWorkers
    from tessera.compilation.work import Job
    from tessera.config import CompileConfig

log = logging.getLogger(__name__)


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
        if isinstance(size, SizeRange) or _compat.ops_of_the_users(item.graph):
            return False  # a range, or an op of the user's code a worker does not have
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
                    check_open()  # not as the process exits: the workers were ended then
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
        if done.unloadable:  # the user's own op: compiled here, as without workers
            log.debug("%s: compiled in this process (%s)", job.work.item.name, done.error)
        elif not CLOSING.is_set():  # a worker ended by the exit is no failure to tell
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


def worker_fan_out(
    owner: FanOutOwner,
    install: Callable[[Job, CompileOutcome], None],
    on_failure: Callable[[Job, str], None],
) -> WorkerFanOut | None:
    """A fan-out of ``owner``'s compiles to its workers; None when it has none, or a compiler
    that cannot use them."""
    from tessera.compilation.compilers import CompilesInWorkers

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
        check_open()  # the process exits: what is left is compiled by the next one
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


def workers_for(owner: FanOutOwner, graph_pool: object, general: bool) -> CompilePool | None:
    """The process's compile workers for ``owner``'s compiles (started at the first use), or None
    where they cannot take them: ``compile_workers=0``, a compiler that does not compile in workers,
    no cache entry (a worker's artifact reaches this process through it), or CUDA graphs
    (``graph_pool``: a capture needs every size at install). ``compile_workers`` unset:
    ``default_count(general)``."""
    from tessera.compilation.compilers import CompilesInWorkers

    if graph_pool is not None or not isinstance(owner.compiler, CompilesInWorkers):
        return None
    if owner.artifact_cache.entry is None:
        return None
    count = owner.config.compile_workers
    return compile_pool.shared_pool(
        compile_pool.default_count(general=general) if count is None else count,
        owner.config.background_priority,
    )
