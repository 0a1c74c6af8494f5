"""The traces earlier processes saved for a model (its fingerprint's pointer, locally or the
fleet's): held, each made one of the model's entries at the first call it covers. With eager first
and a remote tier, the fleet's pointer is fetched by the first trace, beside eager's first output
(``TraceContext.fetch_deferred``). A part of ``traces.Traces``, kept apart for its one job."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from typing import Any

from tessera import counters
from tessera.cache.pointer import OtherPath
from tessera.config import CompileConfig
from tessera.errors import first_line
from tessera.trace import warm
from tessera.trace.trace_entry import Model, TraceContext, TraceEntry, make_entry
from tessera.trace.trace_plan import TracePlan, merged_plans, plan_from_json
from tessera.trace.trace_route import Nearest

log = logging.getLogger(__name__)


class SavedTraces:
    """The saved traces of one model, held until a call needs one (mixed into ``Traces``, which
    owns the entries, the lock and the routing this reads)."""

    model: Model
    config: CompileConfig
    context: TraceContext
    entries: tuple[TraceEntry, ...]
    held: list[TraceEntry]
    plan: TracePlan
    warm_refused: str | None
    _lock: threading.RLock
    _fleet_pending: bool  # the fleet's traces, still to fetch
    # One fetch. The trace thread takes it, then ``_lock``; the calling thread, under ``_lock``
    # (the first call's), takes it only when no trace is in flight beside eager (``Beside.busy``).
    _fetch_lock: threading.Lock

    def _next_number(self) -> int:
        raise NotImplementedError

    def _serve_existing(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        among: list[TraceEntry] | None = None,
        serve: bool = True,
    ) -> tuple[Any] | None:
        raise NotImplementedError

    def _serving(self, entry: TraceEntry) -> None:
        raise NotImplementedError

    def _nearest(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], among: list[TraceEntry] | None = None
    ) -> Nearest:
        raise NotImplementedError

    def load_saved(self) -> OtherPath | None:
        """Add every trace an earlier process saved for this fingerprint that loads here; the path
        an earlier process recorded the model to run on instead, if one did (graph breaks)."""
        context = self.context
        if context.root is None or context.fingerprint is None:
            return None
        found = warm.load(
            self.config, context.root, context.prefix, context.fingerprint, self.model.traced_fn
        )
        plan = plan_from_json(warm.load_plan(context.root, context.fingerprint))
        with self._lock:
            self.warm_refused = found.refused
            for trace in found.traces:
                fast = functools.partial(trace.call, self.model.target)
                number = self._next_number()
                held = make_entry(
                    self.model,
                    context,
                    number,
                    trace.spec,
                    fast,
                    trace.split_model,
                    trace.reason,
                    loaded=True,
                )
                self.held.append(held)
            self.plan = merged_plans(self.plan, plan)
        return found.other_path

    def fetch_fleet(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TraceEntry | Nearest | None:
        """Where the fleet's pointer is still to fetch (``TraceContext.fetch_deferred``): fetch it,
        hold the traces it leads to, and serve from now on the one that covers this call. That
        entry; or, where the fleet's traces cover another call, the nearest (the call is traced with
        what it changed, as at a warm start); None: nothing fetched. Done once, by whichever thread
        traces first. A failure is said once and leaves the local cache alone to serve."""
        with self._fetch_lock:
            if not self._fleet_pending:
                return None
            try:
                if not self.context.fetch_fleet():
                    return None
                other = self.load_saved()
            except Exception as e:  # the fleet is a cache: never a reason not to trace
                log.warning(
                    "%s: the fleet's traces were not fetched (%s); tracing the call",
                    self.model.name,
                    first_line(e),
                    exc_info=log.isEnabledFor(logging.DEBUG),
                )
                return None
            finally:
                self._fleet_pending = False
        if other is not None:  # recorded meanwhile by another process here: graph breaks
            log.info("%s: %s (recorded by another process)", self.model.name, other)
            return None
        with self._lock:
            entry = self._adopt_saved(args, kwargs)
            if entry is not None:
                self._serving(entry)
                return entry
            if not self.held:
                return None
            counters.bump("warm_start_fallbacks")  # the fleet's traces, none for this call
            nearest = self._nearest(args, kwargs, among=self.held)
            self.warm_refused = f"this call differs from the fleet's traces: {nearest.words}"
            log.info("%s: %s; tracing it", self.model.name, self.warm_refused)
            return nearest

    def _take_saved(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any] | None:
        """The output of a saved trace that covers this call, made one of the model's entries (it
        counts against ``max_traces`` from then on, as a trace made here would); None if none does.
        A saved trace past the limit is refused as a new trace would be."""
        with self._lock:
            entry = self._adopt_saved(args, kwargs)
            return None if entry is None else self._serve_existing(args, kwargs, among=[entry])

    def _adopt_saved(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> TraceEntry | None:
        """The saved trace that covers this call, made one of the model's entries; None if none
        does, or the limit is reached (caller holds the lock)."""
        for held in reversed(self.held):  # the newest first: the widest
            if self._serve_existing(args, kwargs, among=[held], serve=False) is None:
                continue
            if len(self.entries) >= self.config.trace_limit:
                return None  # the caller refuses it, naming the limit
            self.held.remove(held)
            held.split_model.background.bring_forward()  # held back here earlier: it serves again
            entry = dataclasses.replace(held, number=self._next_number())
            self.entries = (*self.entries, entry)
            return entry
        return None
