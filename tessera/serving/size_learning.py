"""Sizes learnt from traffic, for one model's pieces: the counter of the sizes served, the
learner's decisions (``learn.SizeLearner``, the policy) and the thread that compiles a learnt size
in every sized piece and swaps it in, or takes a retired one out (the mechanism)."""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tessera import counters
from tessera.compilation.artifact_cache import ArtifactCache, CompileOutcome
from tessera.compilation.background import start_thread
from tessera.compilation.compile_pool import CompilePool
from tessera.compilation.compile_state import COMPILE_LOCK, CompileState
from tessera.compilation.compilers import Compiler
from tessera.compilation.fan_out import obtain_all, warn_once, worker_fan_out, workers_for
from tessera.compilation.piece import PieceRecord, free_symbols, shape_sources
from tessera.compilation.piece_inputs import fixed, inputs_at
from tessera.compilation.split import SplitItem
from tessera.compilation.work import Job, PieceWork, Work
from tessera.config import CompileConfig, Counted, Shape, Size, size_label, static_size
from tessera.serving.learn import SizeLearner, SizeTally
from tessera.serving.pieces import Pieces

log = logging.getLogger(__name__)


class LearningOwner(Protocol):
    """What the learning reads and changes of the model's pieces (split_model.SplitModel)."""

    config: CompileConfig
    prefix: str
    state: CompileState
    compiler: Compiler
    artifact_cache: ArtifactCache
    phases: dict[str, float]
    pieces: Pieces
    pool: CompilePool | None  # compile workers (started for the learnt sizes where none were)

    def jobs_left(self) -> bool: ...  # the background compile still has the trace's own sizes

    def add_artifact(self, item: SplitItem, size: Size, outcome: CompileOutcome) -> None: ...


@dataclass
class LoadedWork:
    """What compiling a loaded piece at a learnt size needs (warm.py): its record (with its inputs
    as traced), its content hash, its graph as saved (unpickled at the first learn, once per
    content: ``graphs``) and, weakly, the fixed inputs (weights) of one call (``keep``)."""

    record: PieceRecord
    content: str
    graph_blob: bytes
    graphs: dict[str, Any]  # content -> graph, shared by the model's loaded pieces
    _real: tuple[weakref.ref[Any] | None, ...] = ()

    @property
    def item(self) -> SplitItem:
        graph = self.graphs.get(self.content)
        if graph is None:
            from tessera.compilation.graph_pickle import load_graph

            graph = self.graphs[self.content] = load_graph(self.graph_blob)
        return SplitItem(self.record.name, self.record.index, False, graph)

    def keep(self, args: tuple[Any, ...]) -> None:
        """The piece's runner hands it a call's inputs: its weights are what a compile is given
        (no copy), while they live."""
        assert self.record.inputs is not None, "a loaded piece learns from its saved inputs"
        self._real = tuple(
            weakref.ref(a) if is_fixed and isinstance(a, torch.Tensor) else None
            for a, is_fixed in zip(args, fixed(self.record.inputs), strict=False)
        )

    def inputs(self, size: Size) -> Callable[[], Sequence[Any]]:
        assert self.record.inputs is not None, "a loaded piece learns from its saved inputs"
        assert isinstance(size, int | Shape), "a loaded piece compiles static sizes only"
        real = tuple(ref() if ref is not None else None for ref in self._real)
        return functools.partial(inputs_at, self.record.name, self.record.inputs, size, real)


class SizeLearning:
    """The sizes one model learns from its traffic (``compile_sizes="auto"``), or only counts."""

    def __init__(self, owner: LearningOwner) -> None:
        self.owner = owner
        # What a learnt size compiles from: each sized piece's work (a traced model), or its
        # graph and inputs as saved (a loaded one: warm.py).
        self.sized: list[PieceWork] = []
        self.loaded: list[LoadedWork] = []
        self._learnable_memo: bool | None = None
        self.tally: SizeTally | None = None
        # What records the learnt sizes for the next process (set by the model's traces).
        self.learnt_sink: Callable[[Any], None] | None = None
        self.idle = threading.Event()  # clear while learnt sizes compile
        self.idle.set()
        self._learn_queue: list[Counted] = []  # sizes learnt, waiting for the learning thread
        self._learn_lock = threading.Lock()  # the queue, and a learnt size's swap in or out
        self._worker_failed = warn_once(owner.prefix)  # a compile worker's failure, warned once
        self._workers_checked = False

    def start(self, learnt: Sequence[Counted] = ()) -> None:
        """Count the sizes served, on the first piece that has a size; with ``auto_sizes``, learn
        the hot ones (``learnt``: those an earlier process learnt, loaded)."""
        runner = next((r for r in self.owner.pieces.runners().values() if r.source), None)
        if runner is None:
            return
        learner = None
        if self.owner.config.auto_sizes:
            learner = SizeLearner(
                self.owner.config.auto_sizes,
                self.owner.config.auto_sizes_share,
                self._listed(runner.name),
                learnt,
                self._learn,
                self._retire,
                self._may_learn,
            )
            if not self.sized and not self.loaded:
                log.info(
                    "%s: auto sizes: the pieces were loaded without their inputs as traced (saved "
                    "since this version), so this process serves the %d learnt size(s) it loaded "
                    "and learns none (a process that traces the model does)",
                    self.owner.prefix,
                    len(learner.learnt),
                )
            elif not self._learnable():
                log.info(
                    "%s: auto sizes: the pieces do not share their dynamic sizes (or one cannot be "
                    "read from a piece's inputs), so none is learnt; mark the dim that varies with "
                    "dynamic_dims",
                    self.owner.prefix,
                )
        self.tally = SizeTally(learner)
        runner.tally = self.tally
        for piece in self.owner.pieces.graph_pieces:  # its replays bypass the runner: counted by the piece
            if piece.fn is runner:
                piece.tally = self.tally

    def _listed(self, name: str) -> tuple[Counted, ...]:
        """The static sizes listed for the piece that counts (``name``), as counted: its
        sizes, and the values of its shapes (never learnt: they are compiled already)."""
        record = self.owner.pieces[name].record
        if record is None:
            return self.owner.config.sizes
        return tuple(s.values if isinstance(s, Shape) else s for s in record.sizes)

    def _learnable(self) -> bool:
        """Whether static sizes can be compiled here: this process traced the pieces or loaded
        them with their inputs and graphs, and they share their dynamic sizes: one (a size is
        learnt), or several that every piece reads (a shape is learnt: batch x length). Worked
        out once: the pieces are built before anything is served."""
        if self._learnable_memo is None:
            symbols = {frozenset(map(str, free_symbols(work.fake_args))) for work in self.sized}
            symbols |= {frozenset(w.record.inputs.symbols) for w in self.loaded if w.record.inputs}
            shared = len(symbols) == 1 and len(next(iter(symbols))) >= 1
            if shared and len(next(iter(symbols))) > 1:
                shared = all(shape_sources(work.fake_args) for work in self.sized) and all(
                    w.record.shape_sources for w in self.loaded
                )
            self._learnable_memo = shared
        return self._learnable_memo

    @property
    def learnt_sizes(self) -> tuple[Counted, ...]:
        """The sizes learnt from traffic that serve now, in the order learnt."""
        learner = self.tally.learner if self.tally is not None else None
        return learner.learnt if learner is not None else ()

    def _may_learn(self) -> bool:
        # The trace's own sizes first: nothing is left for the background compile.
        return not self.owner.jobs_left() and self._learnable()

    def _learn(self, size: Counted) -> None:
        """Queue ``size`` for the learning thread (started when none runs): it compiles every
        sized piece at that size and swaps them in (as a background compile does), then records
        the learnt sizes for the next process."""
        with self._learn_lock:
            self._learn_queue.append(size)
            if not self.idle.is_set():
                return
            self.idle.clear()
        if start_thread(f"tessera-learn-{self.owner.prefix}", self._learn_loop) is None:
            with self._learn_lock:  # the process exits: the next one learns again
                self._learn_queue.clear()
                self.idle.set()

    def _learn_loop(self) -> None:
        assert self.tally is not None and self.tally.learner is not None
        learner = self.tally.learner
        while True:
            with self._learn_lock:
                if not self._learn_queue:
                    self.idle.set()
                    return
                size = self._learn_queue.pop(0)
            if self._compile_learnt(size):
                learner.look(decay=False)  # the next hot size now, not EVERY calls later

    def _compile_learnt(self, size: Counted) -> bool:
        """Compile and swap in one learnt size (or shape); whether it was."""
        assert self.tally is not None and self.tally.learner is not None
        learner = self.tally.learner
        start = time.perf_counter()
        static = static_size(size)
        try:
            obtained: list[tuple[SplitItem, CompileOutcome]] = []

            def install(job: Job, outcome: CompileOutcome) -> None:
                obtained.append((job.work.item, outcome))

            def here(job: Job) -> None:
                work, cache = job.work, self.owner.artifact_cache
                key = cache.content_key(work.content, static)
                with COMPILE_LOCK.after_traces():
                    install(
                        job, cache.get(work.item.graph, work.inputs(static), static, work.item.index, key)
                    )

            # Each piece to the compile workers where there are some: a compile here would hold
            # the GIL that the calls served meanwhile need (compile_pool.py).
            works: list[Work] = [*self.sized, *self.loaded]
            jobs = [Job(work, static) for work in works]
            with self.owner.state.applied():
                obtain_all(jobs, worker_fan_out(self._with_workers(), install, self._worker_failed), here)
            with COMPILE_LOCK:
                self.owner.artifact_cache.flush()
            with self._learn_lock:
                if size not in learner.learnt:  # retired while it compiled: the artifacts stay unused
                    return False
                for item, outcome in obtained:  # every piece at once
                    self.owner.add_artifact(item, static, outcome)
                if isinstance(static, int):
                    self.owner.pieces.add_capture_sizes([static])  # captured from the next call it pads
            counters.bump("sizes_learnt")
            self.owner.phases["learn_sizes"] = (
                self.owner.phases.get("learn_sizes", 0.0) + time.perf_counter() - start
            )
            log.info(
                "%s: %s learnt in %.2fs", self.owner.prefix, size_label(static), time.perf_counter() - start
            )
            if self.learnt_sink is not None:
                try:
                    self.learnt_sink(self.owner)
                except Exception as e:  # a hint for the next process: never a failure here
                    log.warning(
                        "%s: the learnt sizes were not recorded (%s: %s)",
                        self.owner.prefix,
                        type(e).__name__,
                        e,
                    )
            return True
        except Exception as e:  # what serves keeps serving; the size is not tried again
            learner.refuse(size)
            log.warning(
                "%s: compiling learnt %s failed (%s: %s); the general artifact keeps serving it",
                self.owner.prefix,
                size_label(static),
                type(e).__name__,
                e,
            )
            return False

    def _with_workers(self) -> LearningOwner:
        """The owner, its compile workers started for the learnt sizes where they can take them
        and none were: a process that loaded its pieces starts none (a warm start compiles
        nothing), nor one whose trace left nothing for them. Not with ``compile_workers=0``, a
        compiler that cannot use them, no cache entry (a worker's artifact reaches this process
        through it), CUDA graphs, or pieces off the CPU (compile_pool.py)."""
        owner = self.owner
        if owner.pool is None and not self._workers_checked:
            self._workers_checked = True
            if self._on_cpu():
                owner.pool = workers_for(owner, owner.pieces.graph_pool, general=True)
        return owner

    def _on_cpu(self) -> bool:
        devices = {a.device.type for w in self.sized for a in w.fake_args if isinstance(a, torch.Tensor)}
        for loaded in self.loaded:
            saved = loaded.record.inputs.inputs if loaded.record.inputs is not None else ()
            devices |= {torch.device(i.device).type for i in saved if i.kind == "tensor"}
        return devices <= {"cpu"}

    def _retire(self, size: Counted) -> None:
        """A learnt size no longer hot: its artifact out of every piece (calls of that size go
        to the general artifact, or a range), and out of the record for the next process."""
        with self._learn_lock:
            for runner in self.owner.pieces.runners().values():
                runner.drop(static_size(size))
            if isinstance(size, int):
                self.owner.pieces.remove_capture_size(size)
        # Recorded for the next process by the learning thread, once the size that takes this
        # one's place is in (a retirement is always for a newcomer): never a write, or a remote
        # publish, on the serving call that made the look.
        counters.bump("sizes_retired")
