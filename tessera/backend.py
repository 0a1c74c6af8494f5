"""``PiecewiseBackend``: the one owner of a compiled model's pieces, from a trace or from the cache.

Trace path: Dynamo calls it with the traced graph → split module → per-piece records from the
example values → runners (compiled or loaded per size) swapped into the split module. Warm path:
``warm.rebuild`` builds the same state from the whole-model artifact, without Dynamo, and
``warm.save_artifact`` writes that artifact from a traced backend. What is left to compile after
the first output is ``schedule.py``'s; the sizes learnt from traffic, ``size_learning.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera import _compat, counters
from tessera.aliases import replay_input_aliases
from tessera.artifact_cache import ArtifactCache, CompileOutcome
from tessera.cache.entry import CacheEntry
from tessera.cache.index import index_key
from tessera.cache.key import (
    SourceFile,
    collect_factors,
    graph_code_objects,
    graph_signature,
    piece_content,
    traced_sources,
)
from tessera.cache.remote import RemoteTier
from tessera.cache.sharing import compile_turn
from tessera.compile_pool import CompilePool, default_count, shared_pool
from tessera.compile_state import COMPILE_LOCK, CompileState
from tessera.compilers import (
    Compiler,
    CompilesInWorkers,
    CountsPartitions,
    KeepsMachineRecord,
    ShowsOutputCode,
)
from tessera.config import CompileConfig, Size, size_label
from tessera.cudagraph import CUDAGraphBackend, CUDAGraphPiece, cuda_graphs_available, resolve_capture_sizes
from tessera.debug.dumps import Dumps
from tessera.errors import TesseraWarning
from tessera.layout import LayoutKeeper, OutputLayout, output_layout
from tessera.piece import (
    PieceRecord,
    PieceRunner,
    dynamic_inputs,
    find_size_source,
)
from tessera.progress import CompileProgress
from tessera.report import Fallback
from tessera.schedule import Background
from tessera.size_learning import SizeLearning
from tessera.split import (
    SplitItem,
    SplitMatcher,
    default_splitting_ops,
    dump_split_graph,
    piece_calls,
    split_graph,
)
from tessera.work import Job, PieceWork

log = logging.getLogger(__name__)
log_cudagraph = logging.getLogger("tessera.cudagraph")


@dataclasses.dataclass
class GraphReceiver:
    """What Dynamo calls with the traced graph (the backend it is given): builds the model's
    ``PiecewiseBackend`` from that graph, whole (``PiecewiseBackend.from_trace``), once."""

    config: CompileConfig
    compiler: Compiler
    cache_root: Path | None
    prefix: str
    remote: RemoteTier | None = None
    serve_traced: bool = False
    # The model's backends by graph (and call state): a trace whose graph is one of them shares
    # its pieces instead of splitting and compiling again (None: never shared).
    shared: dict[str, PiecewiseBackend] | None = None
    backend: PiecewiseBackend | None = None  # None until Dynamo has called

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        # The inputs' strides too: a compiled piece assumes the layouts it was compiled for.
        strides = [
            tuple(map(str, v.stride())) if isinstance(v, torch.Tensor) else None for v in example_inputs
        ]
        key = f"{graph_signature(gm)}:{strides}:{_compat.call_state()!r}"
        existing = self.shared.get(key) if self.shared is not None else None
        if existing is not None and existing.split_forward is not None:
            counters.bump("graphs_shared")
            self.backend = existing
            return existing.split_forward
        backend = PiecewiseBackend.from_trace(
            gm,
            example_inputs,
            self.config,
            self.compiler,
            self.cache_root,
            self.prefix,
            remote=self.remote,
            serve_traced=self.serve_traced,
        )
        self.backend = backend
        if self.shared is not None:
            self.shared[key] = backend
        assert backend.split_forward is not None
        return backend.split_forward

    def received(self) -> PiecewiseBackend:
        """The backend Dynamo's graph built; one without pieces when Dynamo made no graph (a
        function with no tensor work calls no backend)."""
        if self.backend is not None:
            return self.backend
        return PiecewiseBackend(self.config, self.compiler, self.cache_root, self.prefix, remote=self.remote)


class PiecewiseBackend:
    """Splits, compiles or loads, and dispatches the pieces of one model.

    Built whole from Dynamo's graph (``from_trace``, through ``GraphReceiver``) or from the
    whole-model artifact of a warm start (``warm.rebuild``). The constructor takes what both know
    before any piece: the cache entry is fixed for its life.
    """

    def __init__(
        self,
        config: CompileConfig,
        compiler: Compiler,
        cache_root: Path | None,
        prefix: str,
        *,
        entry: CacheEntry | None = None,
        remote: RemoteTier | None = None,
        serve_traced: bool = False,
        sources: Sequence[SourceFile] = (),
        phases: dict[str, float] | None = None,
        state: CompileState | None = None,
    ) -> None:
        """``entry``: the cache entry artifacts are read from and recorded in (None: no cache);
        ``state``: the traced call's state, which every compile of this model runs under."""
        self.config = config
        self.state = state if state is not None else CompileState.current()
        self.remote = remote  # the fleet's shared store behind the local cache (cache/remote.py)
        self.compiler = compiler
        self.cache_root = cache_root
        self.prefix = prefix
        if cache_root is not None and isinstance(compiler, KeepsMachineRecord):
            compiler.use_machine_record(cache_root)
        self.artifact_cache = ArtifactCache(compiler, config, entry)
        self.sources: list[SourceFile] = list(sources)
        self.items: list[SplitItem] = []  # trace path only
        self.order: list[tuple[str, bool]] = []  # every piece in order: (name, is_splitting)
        self.split_gm: torch.fx.GraphModule | None = None  # trace path only
        self.split_forward: Callable[..., Any] | None = None  # what the model's bytecode calls
        self.layouts: dict[str, OutputLayout | None] = {}
        self.records: dict[str, PieceRecord] = {}
        self.runners: dict[str, PieceRunner] = {}
        self.contents: dict[str, str] = {}  # compiled piece -> hash of its content
        # seconds per phase (split, compile, load_kernels, ...)
        self.phases: dict[str, float] = dict(phases) if phases is not None else {}
        # (piece, size, how obtained, when: wall-clock seconds), in the order obtained
        self.outcomes: list[tuple[str, Size, CompileOutcome, float]] = []
        self.artifact_status = "not written (cache disabled)"  # the whole-model artifact's fate
        # Serve first, specialise after: what is left for after the first output (schedule.py).
        self.background = Background(self, before_ready=self._look_at_sizes)
        # Whether a piece may serve as traced (eagerly) until its general artifact is compiled in
        # the background (CompileConfig.serve_while_compiling). The model sets it for its dynamic
        # trace; a trace for one small size compiles at once (that size is the whole workload).
        self.serve_traced = serve_traced
        self.pool: CompilePool | None = None  # compile workers for this model's static sizes
        # CUDA graphs: one backend (memory pool) for every piece and size of this model.
        self.graph_backend = CUDAGraphBackend() if cuda_graphs_available(config.cudagraph_mode) else None
        self.capture_sizes = resolve_capture_sizes(config.cudagraph_capture_sizes, config.max_size)
        self.graph_pieces: list[CUDAGraphPiece] = []
        self.dumps = Dumps(Path(config.debug_dump_dir), prefix) if config.debug_dump_dir else None
        self.learning = SizeLearning(self)  # sizes learnt from traffic (size_learning.py)
        if config.auto_sizes and config.cudagraph_capture_sizes is None:
            # The learnt sizes are the capture sizes (with the listed ones): a call pads to the
            # next of them, and runs without a graph above the largest.
            self.capture_sizes = tuple(
                s for s in config.sizes if config.max_size is None or s <= config.max_size
            )

    # -- trace path ----------------------------------------------------------------------------
    @classmethod
    def from_trace(
        cls,
        gm: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        config: CompileConfig,
        compiler: Compiler,
        cache_root: Path | None,
        prefix: str,
        *,
        remote: RemoteTier | None = None,
        serve_traced: bool = False,
    ) -> PiecewiseBackend:
        """A complete backend from Dynamo's traced graph: split at the splitting ops, its cache
        entry made, every piece compiled or loaded (or, in the background, left for
        ``Background.start``) and swapped into the split module (``split_forward``)."""
        counters.bump("graphs_traced")
        if config.mode == "trace_once" or config.cudagraph_mode == "full" or config.graph_partition:
            # One piece, the whole graph: captured whole ("full"), or partitioned by Inductor itself.
            specs: Sequence[Any] = ()
        elif config.splitting_ops is None:
            specs = default_splitting_ops()
        else:
            specs = config.splitting_ops
        start = time.perf_counter()
        matcher = SplitMatcher(specs)
        split_gm, items = split_graph(gm, matcher)
        replay_input_aliases(gm, split_gm)
        if config.splitting_ops:
            for name in matcher.unmatched():
                warnings.warn(
                    f"splitting op {name!r} matches no call in the traced graph of {prefix}; "
                    "check the name (see computation_graph.py in the cache entry for what was traced)",
                    TesseraWarning,
                    stacklevel=2,
                )
        split_dump = dump_split_graph(split_gm, items)
        sources: list[SourceFile] = []
        entry = None
        factors: dict[str, Any] | None = None
        if cache_root is not None:
            sources = traced_sources(graph_code_objects(gm))
            factors = collect_factors(
                config, compiler.name, compiler.compute_hash(), sources, graph_signature(gm)
            )
            entry = CacheEntry.create(cache_root, prefix, factors, split_dump, sources)
        backend = cls(
            config,
            compiler,
            cache_root,
            prefix,
            entry=entry,
            remote=remote,
            serve_traced=serve_traced,
            sources=sources,
            state=CompileState.current(),  # Dynamo calls us in the traced call's thread
        )
        _compat.trace_artifact("tessera_split_graph", lambda: split_dump)
        if backend.dumps is not None:
            backend.dumps.traced_graph(gm.code)
            backend.dumps.split_graph(split_dump)
            if factors is not None:
                backend.dumps.factors(factors)
        backend._build_pieces(gm, split_gm, items, example_inputs, start)
        return backend

    def _build_pieces(
        self,
        gm: torch.fx.GraphModule,
        split_gm: torch.fx.GraphModule,
        items: Sequence[SplitItem],
        example_inputs: Sequence[Any],
        start: float,
    ) -> None:
        """Install a runner for every piece of the split module (from_trace's second half)."""
        self.split_gm, self.items = split_gm, list(items)
        self.order = [(item.name, item.is_splitting) for item in items]
        counters.bump("pieces", len(items))
        counters.bump("compiled_pieces", sum(not item.is_splitting for item in items))
        log.debug(
            "traced graph of %d nodes split into %d piece(s) (%d compiled)",
            len(gm.graph.nodes),
            len(items),
            sum(not item.is_splitting for item in items),
        )
        for item in items:
            if item.is_splitting:
                # The split module calls self.submod_N(...): an instance attribute shadows the
                # submodule, so calls go straight to ours while the GraphModule stays printable.
                kept = self.layout_kept(item.name, item.graph.forward, output_layout(item.graph))
                split_gm.__dict__[item.name] = kept
        built = time.perf_counter()
        self.phases["split"] = built - start
        calls = piece_calls(split_gm, items, list(example_inputs))
        later = self._background()
        needed = {
            index_key(s, item.index, self.compiler.name)
            for item, fake, _ in calls
            for s in (self._sizes(fake)[:1] if later else self._sizes(fake))
        }
        # Started now, so that the workers import Inductor while the general artifacts compile.
        self.pool = self._compile_pool(any(_worker_fit(fake) for _, fake, _ in calls))
        # Up front with workers: every general artifact here first, then the rest at once, the
        # static sizes in the workers (as in the background, but before the first output).
        rest_now = not later and self.pool is not None
        entry = self.artifact_cache.entry
        turn = compile_turn(entry, needed, self.remote) if entry is not None else contextlib.nullcontext()
        progress = CompileProgress(self.prefix, len(needed))
        try:
            with COMPILE_LOCK, turn:
                try:
                    for item, fake_args, real_args in calls:
                        self._build(
                            split_gm, item, fake_args, real_args, progress, general_only=later or rest_now
                        )
                    if rest_now:
                        self.background.compile_all(progress)
                finally:
                    # One index write for the turn (not one per piece or link: that made a cold
                    # start quadratic in the layers), before the turn lets sibling ranks read it.
                    self.artifact_cache.flush()
        finally:
            progress.close()
        if not self.background.left():
            self.background.ready.set()
        self.learning.start()
        self.phases["compile"] = time.perf_counter() - built
        log.debug("built %d piece runner(s) in %.2fs", len(self.runners), self.phases["compile"])
        # forward, not __call__: skips nn.Module call machinery on every step.
        self.split_forward = split_gm.forward

    def _build(
        self,
        split_gm: torch.fx.GraphModule,
        item: SplitItem,
        fake_args: Sequence[Any],
        real_args: Sequence[Any | None],
        progress: CompileProgress,
        general_only: bool = False,
    ) -> None:
        """Compile (or load) every artifact of one non-splitting piece and install its runner;
        ``general_only``: the general one now, the sizes and ranges left for the background."""
        config = self.config
        output = next(iter(reversed(item.graph.graph.nodes)))
        returns_tuple = isinstance(output.args[0], (tuple, list))
        source = find_size_source(fake_args)
        sizes = self._sizes(fake_args)
        content = piece_content(item.graph, fake_args)
        self.contents[item.name] = content
        now = sizes[:1] if general_only else sizes
        found = None
        if general_only and self._serves_traced():
            found = self.artifact_cache.find(
                item.graph, now[0], item.index, self.artifact_cache.content_key(content, now[0])
            )
            if found is None:
                # The first output waits for the trace alone: the piece runs as traced, the same
                # kernels as eager, until its general artifact (compiled first) is swapped in.
                now = ()
        work = PieceWork(item, fake_args, real_args, content)
        if source is not None:
            self.learning.sized.append(work)
        self.background.jobs.extend(Job(work, size) for size in sizes[len(now) :])
        artifacts: dict[Size, Callable[..., Any]] = {} if now else {None: item.graph.forward}
        seconds = []
        timings = []
        for size in now:
            progress.start(item.name, size_label(size))
            outcome = found or self.artifact_cache.get(
                item.graph,
                work.inputs(size),
                size,
                item.index,
                self.artifact_cache.content_key(content, size),
            )
            progress.advance()
            self._record_stage(item, size, outcome)
            artifacts[size] = outcome.fn
            self.outcomes.append((item.name, size, outcome, time.time()))
            seconds.append((size_label(size), outcome.seconds))
            timings.append((size_label(size), outcome.seconds, outcome.source))
        if timings:  # nothing obtained now: the piece serves as traced
            progress.piece_done(item.name, timings)
        returned = output.args[0] if returns_tuple else [output.args[0]]
        outputs = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in returned]
        record = PieceRecord(
            name=item.name,
            index=item.index,
            is_splitting=False,
            sym_positions=tuple(i for i, a in enumerate(fake_args) if isinstance(a, torch.SymInt)),
            returns_tuple=returns_tuple,
            size_source=source,
            sizes=self.compile_sizes if source is not None else (),
            ranges=tuple(config.ranges) if source is not None else (),
            compile_seconds=tuple(seconds),
            dynamic=dynamic_inputs(fake_args, outputs),
            partitions=_partitions(self.compiler, artifacts.get(None)),
        )
        runner = PieceRunner(item.name, artifacts, source, config.max_size, traced_general=not now)
        runner.as_traced = item.graph.forward
        split_gm.__dict__[item.name] = self.install_runner(record, runner)

    # -- serve first, specialise after ----------------------------------------------------------
    def _serves_traced(self) -> bool:
        # Not with a remote tier: the fleet's compile turn (one replica compiles, the others wait
        # and load) covers what the first call compiles, and a piece served as traced is not
        # compiled in that turn, so every replica would compile it.
        return (
            self.serve_traced
            and self._background()
            and self.config.serve_while_compiling
            and self.compiler.name != "eager"
            and self.remote is None
        )

    def _background(self) -> bool:
        """Whether sizes and ranges compile after the first output. Not with CUDA graphs (a
        captured graph holds the artifact it was captured with)."""
        return self.config.background_compile and self.graph_backend is None

    def jobs_left(self) -> bool:
        """Whether artifacts of the trace's own sizes are still to compile (learning waits)."""
        return self.background.left()

    def _look_at_sizes(self) -> None:
        """The sizes counted while the trace's own sizes compiled are learnt now, not at the next
        look (run by the background compile before it says every size is in place)."""
        tally = self.learning.tally
        learner = tally.learner if tally is not None else None
        if learner is not None:
            learner.look(decay=False)

    def add_artifact(
        self, item: SplitItem, size: Size, outcome: CompileOutcome, progress: CompileProgress | None = None
    ) -> None:
        """Swap one artifact compiled after its piece's general one into the piece's runner."""
        self.runners[item.name].add(size, outcome.fn)
        record = self.records[item.name]
        self.records[item.name] = dataclasses.replace(
            record,
            compile_seconds=(*record.compile_seconds, (size_label(size), outcome.seconds)),
            partitions=_partitions(self.compiler, outcome.fn) if size is None else record.partitions,
        )
        self.outcomes.append((item.name, size, outcome, time.time()))
        self._record_stage(item, size, outcome)
        if progress is not None:
            progress.advance()

    # -- compile workers ------------------------------------------------------------------------
    def _compile_pool(self, sized: bool) -> CompilePool | None:
        """The compile workers, when some of this model can go to them: CPU pieces with a size
        (``sized``) and static compile sizes for them, a compiler that compiles in workers, a
        cache entry for their files, no CUDA graphs (a capture needs every size at install), and
        workers asked for."""
        if (
            not sized
            or not self.compile_sizes
            or self.graph_backend is not None
            or not isinstance(self.compiler, CompilesInWorkers)
            or self.artifact_cache.entry is None
        ):
            return None
        count = self.config.compile_workers
        return shared_pool(default_count() if count is None else count)

    def _record_stage(self, item: SplitItem, size: Size, outcome: CompileOutcome) -> None:
        """One artifact obtained: in torch's structured trace, and in the debug dumps."""
        event = {"piece": item.name, "size": size_label(size), "source": outcome.source}
        _compat.trace_artifact(
            "tessera_piece", lambda: json.dumps({**event, "seconds": round(outcome.seconds, 6)})
        )
        if self.dumps is not None:
            code = (
                self.compiler.output_code(outcome.fn) if isinstance(self.compiler, ShowsOutputCode) else None
            )
            self.dumps.piece(item.name, size_label(size), code or item.graph.code)

    def _sizes(self, fake_args: Sequence[Any]) -> tuple[Size, ...]:
        """What a piece is compiled for: general, then each compile size and range if it has a size."""
        if find_size_source(fake_args) is None:
            return (None,)
        return (None, *self.compile_sizes, *self.config.ranges)

    @property
    def compile_sizes(self) -> tuple[int, ...]:
        """The compile sizes this trace serves: every size for an unbacked or size-oblivious
        trace; sizes >= 2 for a trace Dynamo specialised at 0 and 1 (those have traces of their own)."""
        if self.config.dynamic_shapes == "unbacked" or self.state.size_oblivious:
            return self.config.sizes
        return tuple(s for s in self.config.sizes if s >= 2)

    # -- shared ------------------------------------------------------------------------------------
    def layout_kept(
        self, name: str, fn: Callable[..., Any], layout: OutputLayout | None
    ) -> Callable[..., Any]:
        """A splitting piece, through a LayoutKeeper when its outputs' layout matters (layout.py)."""
        self.layouts[name] = layout
        # The eager compiler runs pieces as Python: any layout is fine, so no copies, no checks.
        if layout is not None and self.compiler.name != "eager":
            return LayoutKeeper(fn, layout)
        return fn

    def install_runner(self, record: PieceRecord, runner: PieceRunner) -> Callable[..., Any]:
        """What the split module calls for this piece: the runner, under CUDA graphs when enabled."""
        self.runners[record.name] = runner
        self.records[record.name] = record
        if self.graph_backend is None or record.size_source is None or record.dynamic is None:
            return runner
        call = CUDAGraphPiece(
            record.name,
            runner,
            record.size_source,
            record.dynamic,
            self.capture_sizes,
            self.graph_backend,
            first=not self.graph_pieces,
            debug=log_cudagraph.isEnabledFor(logging.DEBUG),
        )
        self.graph_pieces.append(call)
        self.records[record.name] = dataclasses.replace(record, cudagraph_sizes=self.capture_sizes)
        return call

    def pieces(self) -> tuple[PieceRecord, ...]:
        """One record per piece, in order, with how many calls each artifact served."""
        out = []
        for index, (name, is_splitting) in enumerate(self.order):
            record = self.records.get(name)
            if record is None:
                record = PieceRecord(name, index, is_splitting)
            elif name in self.runners:
                record = dataclasses.replace(record, served=self.runners[name].served())
            out.append(record)
        return tuple(out)

    @property
    def entry(self) -> CacheEntry | None:
        """The cache entry in use; None when the cache is off or stepped aside for this model."""
        return self.artifact_cache.entry

    @property
    def loaded(self) -> int:
        return self.artifact_cache.loaded

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        """Piece artifacts the cache held that could not serve, and why (each obtained again)."""
        return tuple(self.artifact_cache.fallbacks)

    @property
    def compiled(self) -> int:
        return self.artifact_cache.compiled


def _worker_fit(fake_args: Sequence[Any]) -> bool:
    """Whether a piece's static sizes can go to a compile worker: it has a size, and its inputs
    are on the CPU (see InductorCompiler.job)."""
    return find_size_source(fake_args) is not None and all(
        not isinstance(a, torch.Tensor) or a.device.type == "cpu" for a in fake_args
    )


def _partitions(compiler: Compiler, fn: Callable[..., Any] | None) -> int | None:
    return compiler.partitions_of(fn) if isinstance(compiler, CountsPartitions) and fn is not None else None
