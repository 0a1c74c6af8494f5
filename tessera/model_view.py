"""What a user reads of a compiled model: its stage, traces, pieces, cache entry and call check.

A base of ``CompiledModel`` (api.py), which holds the state these read; apart from it so that the
class that serves calls stays small.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tessera.lifecycle import Lifecycle, Stage

if TYPE_CHECKING:
    from tessera.compilation.piece import PieceRecord
    from tessera.report import GuardedGraph
    from tessera.serving.split_model import SplitModel
    from tessera.trace import call_check
    from tessera.trace.trace_entry import TraceEntry
    from tessera.trace.traces import Traces
    from tessera.trace.wrapper import DynamicDims


class ModelView:
    """The read-only properties of ``CompiledModel`` (its state is set by api.py)."""

    _life: Lifecycle
    _traces: Traces | None
    _graphs: list[GuardedGraph]
    _target: Callable[..., Any]
    _dynamic_dims: DynamicDims | None

    @property
    def stage(self) -> Stage:
        """Where this model is in its life: unbuilt, tracing or ready."""
        return self._life.stage

    @property
    def call_spec(self) -> call_check.CallSpec | None:
        """What the trace serving last assumed of every call (None before the first trace)."""
        return self._life.spec

    @property
    def traces(self) -> tuple[TraceEntry, ...]:
        """Every trace the model holds, in the order made or loaded (each with its reason)."""
        return () if self._traces is None else self._traces.entries

    @property
    def _split_model(self) -> SplitModel | None:
        traces = self.traces
        return traces[0].split_model if traces else None

    @property
    def pieces(self) -> tuple[PieceRecord, ...]:
        """One frozen record per piece of the first trace (empty before it, and without pieces)."""
        return () if self._split_model is None else self._split_model.records()

    @property
    def cache_dir(self) -> Path | None:
        """Where this model's artifacts live; None when the cache is disabled or not yet used."""
        split_model = self._graphs[0].split_model if self._graphs else self._split_model
        return split_model.entry.path if split_model is not None and split_model.entry is not None else None

    @property
    def runners(self) -> dict[str, Any]:
        """Compiled piece name -> its runner (what the split module calls for it)."""
        return self._split_model.pieces.runners() if self._split_model is not None else {}

    @property
    def trace_code(self) -> types.CodeType | None:
        """Dynamo's transformed code of the first traced entry (None when every trace was loaded)."""
        return next((e.code for e in self.traces if e.code is not None), None)

    @property
    def check_namespace(self) -> dict[str, Any]:
        """What the call check reads besides the arguments (the model, the objects it holds)."""
        last = self._traces.last if self._traces is not None else None
        return dict(last.bound) if last is not None else {}

    @property
    def marked_dims(self) -> list[tuple[str, int]]:
        """The dims the first trace marked dynamic."""
        return list(self._traces.marked_dims) if self._traces is not None else []

    @property
    def dropped_guards(self) -> tuple[tuple[str, int], ...]:
        """Dynamo guards of the latest trace not re-checked, and why."""
        return self._traces.dropped_guards if self._traces is not None else ()

    @property
    def warm_start_refused(self) -> str | None:
        """Why a saved trace did not serve the first call (None: one did, or none was saved)."""
        return self._traces.warm_refused if self._traces is not None else None

    @property
    def target(self) -> Callable[..., Any]:
        """What the traced frame calls: the model's forward."""
        return self._target

    @property
    def dynamic_dims(self) -> DynamicDims | None:
        return self._dynamic_dims

    @property
    def split_graph(self) -> torch.fx.GraphModule | None:
        """The split module (pieces as submodules) of the first trace, when it was traced here."""
        return self._split_model.split_gm if self._split_model is not None else None
