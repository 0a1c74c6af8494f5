"""A model's pieces: one ``Piece`` record each, and the small class that owns them in order.

A ``Piece`` holds everything tessera knows of one piece of the split module: where it sits, its
traced graph and example inputs (trace path), its content key, the layout a splitting piece's
outputs keep, the dispatch record of a compiled piece and its runner. ``Pieces`` owns them, and
with them the runner install (under CUDA graphs when enabled) and the CUDA graph capture sizes.
Before this there were six name-keyed dicts on the backend, and no one place said which part
owned a piece's state.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.compilation.layout import LayoutKeeper, OutputLayout
from tessera.compilation.piece import PieceRecord, PieceRunner
from tessera.compilation.split import SplitItem
from tessera.config import CompileConfig, Size
from tessera.serving.cudagraph import (
    CUDAGraphPiece,
    CUDAGraphPool,
    cuda_graphs_available,
    resolve_capture_sizes,
)

log_cudagraph = logging.getLogger("tessera.serving.cudagraph")


@dataclass
class Piece:
    """One piece of a model. Filled in as it is built: the place first, then (compiled pieces)
    the record and runner, or (splitting pieces) the layout their outputs keep."""

    name: str
    index: int
    is_splitting: bool
    item: SplitItem | None = None  # its traced graph (trace path only)
    content: str | None = None  # the hash of a compiled piece's content (trace path only)
    layout: OutputLayout | None = None  # a splitting piece's outputs' layout, where it matters
    record: PieceRecord | None = None  # how a compiled piece dispatches, and what it holds
    runner: PieceRunner | None = None  # a compiled piece's artifacts, by size


class Pieces:
    """A model's pieces in order, their runners' install and the CUDA graph capture sizes."""

    def __init__(self, config: CompileConfig, compiler_name: str) -> None:
        self.config = config
        self.compiler_name = compiler_name
        self._by_name: dict[str, Piece] = {}
        # CUDA graphs: one memory pool for every piece and size of this model.
        self.graph_pool = CUDAGraphPool() if cuda_graphs_available(config.cudagraph_mode) else None
        self.capture_sizes = resolve_capture_sizes(config.cudagraph_capture_sizes, config.max_size)
        if config.auto_sizes and config.cudagraph_capture_sizes is None:
            # The learnt sizes are the capture sizes (with the listed ones): a call pads to the
            # next of them, and runs without a graph above the largest.
            self.capture_sizes = tuple(
                s for s in config.sizes if config.max_size is None or s <= config.max_size
            )
        self.graph_pieces: list[CUDAGraphPiece] = []

    # -- the pieces ----------------------------------------------------------------------------
    def place(self, items: Sequence[SplitItem]) -> None:
        """The traced pieces, in the split module's order."""
        self._by_name = {
            item.name: Piece(item.name, index, item.is_splitting, item=item)
            for index, item in enumerate(items)
        }

    def place_names(self, names: Sequence[str], splitting: set[str]) -> None:
        """The pieces of a whole-model artifact (no graphs), in the split module's order."""
        self._by_name = {name: Piece(name, index, name in splitting) for index, name in enumerate(names)}

    def __iter__(self) -> Iterator[Piece]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def __getitem__(self, name: str) -> Piece:
        return self._by_name[name]

    def runners(self) -> dict[str, PieceRunner]:
        """Every compiled piece's runner, by name, in order."""
        return {p.name: p.runner for p in self if p.runner is not None}

    def records(self) -> tuple[PieceRecord, ...]:
        """One record per piece, in order, with how many calls each artifact served."""
        out = []
        for piece in self:
            record = piece.record
            if record is None:
                record = PieceRecord(piece.name, piece.index, piece.is_splitting)
            elif piece.runner is not None:
                record = dataclasses.replace(record, served=piece.runner.served())
            out.append(record)
        return tuple(out)

    # -- what the split module calls -----------------------------------------------------------
    def layout_kept(
        self, name: str, fn: Callable[..., Any], layout: OutputLayout | None
    ) -> Callable[..., Any]:
        """A splitting piece, through a LayoutKeeper when its outputs' layout matters (layout.py)."""
        self._piece(name, True).layout = layout
        # The eager compiler runs pieces as Python: any layout is fine, so no copies, no checks.
        if layout is not None and self.compiler_name != "eager":
            return LayoutKeeper(fn, layout)
        return fn

    def install_runner(self, record: PieceRecord, runner: PieceRunner) -> Callable[..., Any]:
        """What the split module calls for this piece: the runner, under CUDA graphs when enabled."""
        piece = self._piece(record.name, False)
        piece.record, piece.runner = record, runner
        if self.graph_pool is None or record.size_source is None or record.dynamic is None:
            return runner
        call = CUDAGraphPiece(
            record.name,
            runner,
            record.size_source,
            record.dynamic,
            self.capture_sizes,
            self.graph_pool,
            first=not self.graph_pieces,
            debug=log_cudagraph.isEnabledFor(logging.DEBUG),
        )
        self.graph_pieces.append(call)
        piece.record = dataclasses.replace(record, cudagraph_sizes=self.capture_sizes)
        return call

    def add_artifact(self, name: str, size: Size, fn: Callable[..., Any], record: PieceRecord) -> None:
        """An artifact compiled after the piece's general one, swapped into its runner."""
        piece = self._by_name[name]
        assert piece.runner is not None, "an artifact is added to an installed runner"
        piece.runner.add(size, fn)
        piece.record = record

    # -- capture sizes -------------------------------------------------------------------------
    def add_capture_sizes(self, sizes: Sequence[int]) -> None:
        """Sizes learnt from traffic: each captured at its next call (calls pad up to it)."""
        if not self.graph_pieces or not sizes:
            return
        for call in self.graph_pieces:
            for size in sizes:
                call.add_capture_size(size)
        self.capture_sizes = tuple(sorted({*self.capture_sizes, *sizes}))

    def remove_capture_size(self, size: int) -> None:
        """A learnt size retired: its graphs let go (calls pad to the next capture size)."""
        for call in self.graph_pieces:
            call.remove_capture_size(size)
        if self.graph_pieces:
            self.capture_sizes = tuple(s for s in self.capture_sizes if s != size)

    def _piece(self, name: str, is_splitting: bool) -> Piece:
        piece = self._by_name.get(name)
        assert piece is not None and piece.is_splitting == is_splitting, f"{name} is not placed"
        return piece
