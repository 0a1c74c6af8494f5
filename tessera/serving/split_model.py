"""``SplitModel``: one traced graph of a model, split into pieces; from a trace or from the cache.

It owns the model's pieces (``pieces.Pieces``: each piece's record, runner and layout, the runner
install under CUDA graphs), the artifact cache they are obtained from, and swaps in artifacts
compiled after the first output. Who builds it: ``build.from_trace`` (Dynamo's
graph, split, each piece compiled or loaded) and ``warm.rebuild`` (the whole-model artifact,
without Dynamo); ``warm.save_artifact`` writes that artifact from a traced one. What is left
to compile after the first output is ``schedule.Background``'s; the sizes learnt from traffic,
``size_learning.SizeLearning``'s.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera import _compat
from tessera.cache.entry import CacheEntry
from tessera.cache.key import SourceFile
from tessera.cache.remote import RemoteTier
from tessera.compilation.artifact_cache import ArtifactCache, CompileOutcome, Obtained
from tessera.compilation.compile_pool import CompilePool
from tessera.compilation.compile_state import CompileState
from tessera.compilation.compilers import (
    Compiler,
    CountsPartitions,
    KeepsMachineRecord,
    ShowsOutputCode,
)
from tessera.compilation.piece import PieceRecord
from tessera.compilation.split import SplitItem
from tessera.config import CompileConfig, Size, size_label
from tessera.debug.dumps import Dumps
from tessera.debug.progress import CompileProgress
from tessera.report import Fallback
from tessera.serving.listed_shapes import TraceShapes
from tessera.serving.pieces import Pieces
from tessera.serving.schedule import Background
from tessera.serving.size_learning import SizeLearning

log = logging.getLogger(__name__)


class ArtifactState(enum.Enum):
    """Where a trace's whole-model artifact stands."""

    OFF = "not written (cache disabled)"
    PENDING = "to be written once every size is compiled"
    WRITTEN = "written"
    LOADED = "loaded"
    NOT_WRITTEN = "not written"


@dataclass(frozen=True)
class ArtifactFate:
    """A trace's whole-model artifact: where it stands, and why it was not written."""

    state: ArtifactState
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.state.value}: {self.reason}" if self.reason else self.state.value


class SplitModel:
    """Splits, compiles or loads, and dispatches the pieces of one model.

    Built whole from Dynamo's graph (``build.from_trace``, through ``receiver.GraphReceiver``) or
    from the whole-model artifact of a warm start (``warm.rebuild``). The constructor takes what both know
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
        self.pieces = Pieces(config, compiler.name)  # every piece's record, runner and layout
        self.split_gm: torch.fx.GraphModule | None = None  # trace path only
        self.split_forward: Callable[..., Any] | None = None  # what the model's bytecode calls
        # seconds per phase (split, compile, load_kernels, ...)
        self.phases: dict[str, float] = dict(phases) if phases is not None else {}
        self.obtained: list[Obtained] = []  # every artifact, in the order obtained
        self.artifact_fate = ArtifactFate(ArtifactState.OFF)  # the whole-model artifact's
        # Serve first, specialise after: what is left for after the first output (schedule.py).
        self.background = Background(self, before_ready=self._look_at_sizes)
        # Whether a piece may serve as traced (eagerly) until its general artifact is compiled in
        # the background (CompileConfig.serve_while_compiling). The model sets it for its dynamic
        # trace; a trace for one small size compiles at once (that size is the whole workload).
        self.serve_traced = serve_traced
        self.pool: CompilePool | None = None  # compile workers for this model's static sizes
        self.dumps = Dumps(Path(config.debug_dump_dir), prefix) if config.debug_dump_dir else None
        self.learning = SizeLearning(self)  # sizes learnt from traffic (size_learning.py)
        # The shapes listed in compile_sizes as this trace reads them (listed_shapes.py).
        self.listed_shapes = TraceShapes()
        self.warned_sizes = False  # listed sizes on pieces with several sizes: said once

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
        record = self.pieces[item.name].record
        assert record is not None, "an artifact is added to a compiled piece"
        record = dataclasses.replace(
            record,
            compile_seconds=(*record.compile_seconds, (size_label(size), outcome.seconds)),
            partitions=partitions_of(self.compiler, outcome.fn) if size is None else record.partitions,
        )
        self.pieces.add_artifact(item.name, size, outcome.fn, record)
        self.note_obtained(item.name, size, outcome)
        self.record_stage(item, size, outcome)
        if progress is not None:
            progress.advance()

    def note_obtained(self, piece: str, size: Size, outcome: CompileOutcome) -> None:
        self.obtained.append(Obtained(piece, size, outcome, time.time()))

    def record_stage(self, item: SplitItem, size: Size, outcome: CompileOutcome) -> None:
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

    def records(self) -> tuple[PieceRecord, ...]:
        """One record per piece, in order, with how many calls each artifact served."""
        return self.pieces.records()

    @property
    def entry(self) -> CacheEntry | None:
        """The cache entry in use; None when the cache is off or stepped aside for this model."""
        return self.artifact_cache.entry

    @property
    def fallbacks(self) -> tuple[Fallback, ...]:
        """Piece artifacts the cache held that could not serve, and why (each obtained again)."""
        return tuple(self.artifact_cache.fallbacks)


def partitions_of(compiler: Compiler, fn: Callable[..., Any] | None) -> int | None:
    return compiler.partitions_of(fn) if isinstance(compiler, CountsPartitions) and fn is not None else None
