"""The background compile of a model's pieces (serve first, specialise after): the jobs a trace
left for after its first output (work.py), the thread that compiles them, general artifacts first so
that pieces serving as traced get compiled code soonest, then every compile size and range, and
what waits for all of them. The thread is started by ``background.start_thread``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from tessera import _compat
from tessera.cache.index import index_key
from tessera.cache.remote import FleetWaitAbandoned, RemoteTier
from tessera.cache.sharing import compile_turn
from tessera.compilation.background import Closing, start_thread
from tessera.compilation.compile_state import COMPILE_LOCK, CompileState
from tessera.compilation.fan_out import obtain_all, warn_once, worker_fan_out
from tessera.compilation.split import SplitItem
from tessera.compilation.work import Job, general_first
from tessera.config import CompileConfig, Size, SizeRange, size_label

if TYPE_CHECKING:
    from tessera.compilation.artifact_cache import ArtifactCache, CompileOutcome
    from tessera.compilation.compile_pool import CompilePool
    from tessera.compilation.compilers import Compiler
    from tessera.debug.progress import CompileProgress

log = logging.getLogger(__name__)


class BackgroundOwner(Protocol):
    """What the background compile (and the learning, size_learning.py) read and change of a
    model's pieces: ``split_model.SplitModel``."""

    config: CompileConfig
    prefix: str
    state: CompileState
    compiler: Compiler
    artifact_cache: ArtifactCache
    phases: dict[str, float]
    pool: CompilePool | None  # compile workers for the static sizes, when the model has them
    remote: RemoteTier | None  # the fleet's tier: the background compile takes its compile turn

    def add_artifact(
        self, item: SplitItem, size: Size, outcome: CompileOutcome, progress: CompileProgress | None = None
    ) -> None: ...


class BackgroundState(str, enum.Enum):
    """Where the background compile of a model's trace is (the report shows the value)."""

    NONE = "none"  # nothing was left for after the first output
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"  # what serves keeps serving; Background.failure says why


class Background:
    """The artifacts a trace left for after its first output (serve first, specialise after), the
    thread that compiles them and swaps each in as it is ready, and what waits for all of them."""

    def __init__(self, owner: BackgroundOwner, before_ready: Callable[[], None]) -> None:
        """``before_ready``: run once the jobs are done, before ``ready`` is set (the learner
        looks at the sizes counted meanwhile, so that a wait for ``ready`` waits for them too)."""
        self.owner = owner
        self.jobs: list[Job] = []
        self.ready = threading.Event()  # set when every artifact of the trace is in place
        self.state = BackgroundState.NONE
        self.failure: str | None = None
        self._before_ready = before_ready
        self._after_ready: list[Callable[[], None]] = []  # run once every size is in place
        self._lock = threading.Lock()
        self._worker_failed = warn_once(owner.prefix)  # a compile worker's failure, warned once per model
        # Held back (traces.py: a later trace widened this one and serves its calls): the jobs
        # left wait for those of the traces that serve, which ``_ahead`` counts this one among.
        self.behind = False
        self._ahead = False

    @property
    def status(self) -> str:
        """The state, with the reason of a failure ("failed: RuntimeError: ...")."""
        return f"failed: {self.failure}" if self.state is BackgroundState.FAILED else self.state.value

    def left(self) -> bool:
        """Whether artifacts are still to compile."""
        return bool(self.jobs)

    def after_ready(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once every size is in place: now if it is, else after the background compile
        (a second trace sharing these pieces saves its whole-model artifact then)."""
        with self._lock:
            if not self.ready.is_set():
                self._after_ready.append(fn)
                return
        fn()

    def hold_back(self) -> None:
        """This trace no longer serves: its jobs left go after those of the traces that do (its
        artifacts serve only a call that takes it back, or a later process that adopts it)."""
        with self._lock:
            self.behind = True
            if self._ahead:
                self._ahead = False
                COMPILE_LOCK.ahead(-1)

    def bring_forward(self) -> None:
        """This trace serves again (a call only it covers took it back): its jobs wait no more."""
        self.behind = False
        COMPILE_LOCK.changed()

    def start(self, then: Callable[[], None] | None = None) -> None:
        """Compile the jobs in a thread of its own (``start_thread``), then run ``then`` (the
        whole-model artifact is written once every size is in place, so that the next process
        loads them all)."""
        if not self.jobs:
            with self._lock:
                self.ready.set()
            if then is not None:
                then()
            return
        self.state = BackgroundState.RUNNING
        if self._compiles_here():
            # Inductor's modules imported here, in the caller's thread, not in the background one:
            # a thread importing them while the user's code imports them too can hand either a
            # partially initialized module (ImportError in the user's code).
            _compat.preload_inductor()
        finish = self.owner.config.finish_at_exit
        if (
            start_thread(f"tessera-compile-{self.owner.prefix}", self._run, then, finish_at_exit=finish)
            is None
        ):
            self.state = BackgroundState.DONE  # the process exits: the next one compiles the rest
            self.ready.set()

    def compile_all(self, progress: CompileProgress | None = None) -> None:
        """Compile every job and swap each artifact in as it is ready: every piece's general
        artifact first (pieces serving as traced get compiled code soonest), then the compile sizes
        and ranges. Static sizes go to the compile workers, when there are any, at once: they
        compile there while the others compile here."""
        owner = self.owner

        def install(job: Job, outcome: CompileOutcome) -> None:
            owner.add_artifact(job.work.item, job.size, outcome, progress)

        def here(job: Job) -> None:
            item, size = job.work.item, job.size
            if progress is not None:
                progress.start(item.name, size_label(size))
            # A trace waiting goes first; a held-back trace's job, after the serving ones'.
            with COMPILE_LOCK.after_traces(behind=lambda: self.behind):
                key = owner.artifact_cache.content_key(job.work.content, size)
                outcome = owner.artifact_cache.get(item.graph, job.work.inputs(size), size, item.index, key)
            install(job, outcome)

        obtain_all(general_first(self.jobs), worker_fan_out(owner, install, self._worker_failed), here)
        self.jobs = []

    def _compiles_here(self) -> bool:
        """Whether a job may compile with Inductor in this process: no compile workers, or a job
        they never take (a range)."""
        from tessera.compilation.inductor_compiler import InductorCompiler

        if not isinstance(self.owner.compiler, InductorCompiler):
            return False
        return self.owner.pool is None or any(isinstance(job.size, SizeRange) for job in self.jobs)

    def _run(self, then: Callable[[], None] | None) -> None:
        owner = self.owner
        start = time.perf_counter()
        try:
            # This thread started with grad enabled and no autocast: compile as the trace was made.
            with self._ahead_of_held():
                with owner.state.applied(), self._turn():
                    self.compile_all()
                    with COMPILE_LOCK:  # the background's artifacts in the index, in one write, in the turn
                        owner.artifact_cache.flush()
                with COMPILE_LOCK:
                    # Every size is in place: said before `then` writes the report that tells it.
                    owner.phases["background_compile"] = time.perf_counter() - start
                    self.state = BackgroundState.DONE
                    if then is not None:
                        then()
        except (FleetWaitAbandoned, Closing):  # the process exits: the next one compiles the rest
            self.state = BackgroundState.DONE
            with contextlib.suppress(Exception), COMPILE_LOCK:  # what was obtained, for the next one
                owner.artifact_cache.flush()
        except Exception as e:  # what serves keeps serving: said once, and in the report
            self.failure = f"{type(e).__name__}: {e}"
            self.state = BackgroundState.FAILED
            log.warning(
                "%s: a background compile failed (%s); what serves now (the general artifacts, "
                "or pieces as traced) keeps serving every size",
                owner.prefix,
                self.failure,
                exc_info=log.isEnabledFor(logging.DEBUG),  # the traceback, for a bug report
            )
        finally:
            owner.phases.setdefault("background_compile", time.perf_counter() - start)
            self.jobs = []
            self._before_ready()
            with self._lock:
                self.ready.set()
            self._run_after_ready()

    @contextlib.contextmanager
    def _ahead_of_held(self) -> Iterator[None]:
        """Counted among the background compiles that held-back traces' jobs wait for
        (``COMPILE_LOCK.ahead``) until this one is done (its index written: a held trace's jobs
        took the lock between the last job and that write), unless held back meanwhile."""
        with self._lock:
            self._ahead = not self.behind
            if self._ahead:
                COMPILE_LOCK.ahead(+1)
        try:
            yield
        finally:
            with self._lock:
                if self._ahead:
                    self._ahead = False
                    COMPILE_LOCK.ahead(-1)

    def _turn(self) -> contextlib.AbstractContextManager[None]:
        """With a remote tier, the fleet's compile turn over every job: one replica compiles
        them, the others wait here (serving as traced meanwhile) and load what it publishes."""
        entry, remote = self.owner.artifact_cache.entry, self.owner.remote
        if entry is None or remote is None:
            return contextlib.nullcontext()
        needed = {index_key(job.size, job.work.item.index, self.owner.compiler.name) for job in self.jobs}
        return compile_turn(entry, needed, remote)

    def _run_after_ready(self) -> None:
        with self._lock:
            waiting, self._after_ready = self._after_ready, []
        for fn in waiting:
            try:
                fn()
            except Exception as e:  # a save that fails costs the next process a trace, no more
                log.warning(
                    "%s: after the background compile: %s: %s", self.owner.prefix, type(e).__name__, e
                )
