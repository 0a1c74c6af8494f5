"""The one owner of a model's traces.

Every trace of a model (the first, and each one made later) is a ``TraceEntry``: the compiled
forward and the check of what its trace assumed (call_check.py). A call runs the entry whose check
passes, trying the one that served last first, so the steady state is one generated comparison. A
call that no entry covers is traced once more, as Dynamo recompiles: the dims and argument ints
that changed are traced as symbols this time (Dynamo's automatic dynamic shapes), the entry is
compiled, cached, saved for the next process (warm.py) and added, and why it was made (the
assumption the nearest entry did not hold) is logged once and listed in the report. Past the
trace limit a call is served eagerly with one warning, or, where ``CompileConfig.max_traces`` was
given, refused, naming every entry and why it was made.

Sizes 0 and 1 need no entry of their own where the trace allows them: the trace is made
size-obliviously (the model's Python decisions on a size are guards; torch's own assume a size
other than 0 or 1), and the few ops whose result depends on a size being 1 bound it
(``wrapper.size_one_symbols``). A model that branches on 1 gets an entry for it, as any other call
its entries do not cover.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from tessera import _compat, counters
from tessera.cache.pointer import OtherPath
from tessera.compilation.compile_state import COMPILE_LOCK
from tessera.config import CompileConfig
from tessera.errors import SizeFixedError, TesseraError, TraceLimitWarning, UnsupportedModelError, first_line
from tessera.report import TraceSpan
from tessera.serving.split_model import ArtifactFate, ArtifactState, SplitModel
from tessera.trace import call_args, call_check, call_shapes, warm
from tessera.trace.assumption import Mismatch
from tessera.trace.beside import Beside
from tessera.trace.grad import as_inference, grad_tensors
from tessera.trace.receiver import GraphReceiver
from tessera.trace.trace_check import TracedAtOne, recorder
from tessera.trace.trace_entry import (
    Model,
    TraceContext,
    TraceEntry,
    changed_arguments,
    make_entry,
    versions,
)
from tessera.trace.trace_plan import (
    TracePlan,
    dims_for,
    hinted,
    mark_call,
    merged_plans,
    nested_tensors,
    newcomer_dims,
    plan_from_json,
    plan_to_json,
    widened,
)
from tessera.trace.trace_route import (
    Nearest,
    changed_since_every_entry,
    covering,
    layout_of_written_input,
    nearest,
    refusal,
    widened_from,
)
from tessera.trace.wrapper import (
    DynamicChoice,
    DynamicDims,
    bind_arguments,
    eager_errors_first,
    trace_once,
)

log = logging.getLogger(__name__)


class Traces:
    """Every trace of one model, and the routing of its calls between them.

    ``install(entry)`` is called with the entry that serves next (the face builds its call from
    ``entry_call``); the lock serialises the making of entries, never a call that an entry serves.
    """

    def __init__(
        self,
        model: Model,
        config: CompileConfig,
        context: TraceContext,
        dynamic_dims: DynamicDims | None,
        install: Callable[[TraceEntry], None],
        lock: threading.RLock,
    ) -> None:
        self.model = model
        self.config = config
        self.context = context
        self.dynamic_dims = dynamic_dims
        self._install = install
        self._lock = lock
        self.entries: tuple[TraceEntry, ...] = ()
        # Traces an earlier process saved, not yet needed: one becomes an entry at the first call
        # it covers, within max_traces (the limit counts what serves, wherever it was traced).
        self.held: list[TraceEntry] = []
        self._numbered = 0  # the last number given to an entry (entries are numbered as made)
        self.last: TraceEntry | None = None
        # The entry just made, and the thread that made it: that thread installs it (builds its
        # check, reports the first trace); a call that finds it meanwhile only runs it.
        self._fresh: tuple[TraceEntry, int] | None = None
        self.plan = TracePlan()
        self.soft_dims = False  # set by presets (tessera.hf): suggested dims, "maybe dynamic"
        self.mark_nested: Callable[[dict[str, Any]], None] | None = None
        self.marked_dims: list[tuple[str, int]] = []
        self.dropped_guards: tuple[tuple[str, int], ...] = ()
        self.trace_seconds = 0.0
        self.warm_refused: str | None = None  # why a saved trace did not serve the first call
        self._said: set[str] = set()
        self._past_limit_said = False  # the one warning of calls served eagerly past the limit
        self._by_graph: dict[str, SplitModel] = {}  # the split_models traced here, by graph
        self._no_oblivious = False  # torch could not trace this model size-obliviously
        # Calls in another syntax than their entry's trace, by shape (call_shapes.py).
        self.shapes: call_shapes.ShapeRoutes[TraceEntry] = call_shapes.ShapeRoutes()
        # Calls no entry covered while a trace is in flight: served eagerly at once (call_shapes.py).
        self.uncovered_calls: call_shapes.UncoveredCalls[TraceEntry] = call_shapes.UncoveredCalls()
        self.beside: Beside | None = None  # eager first: calls no entry covers (beside.py)
        self._fleet_pending = context.fetch_deferred  # the fleet's traces, still to fetch
        self._fetch_lock = threading.Lock()  # one fetch of the fleet's traces (fetch_fleet)

    # -- making entries ---------------------------------------------------------------------
    def trace_beside(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str, mismatches: list[Mismatch]
    ) -> None:
        """The trace made beside eager (beside.py): of the fleet's traces, the one that covers the
        call serves it if there is one (nothing traced); else the call is traced, not run."""
        found = self.fetch_fleet(args, kwargs)
        if isinstance(found, TraceEntry):
            return
        if found is not None:
            reason, mismatches = found.words, found.mismatches
        self.trace(args, kwargs, reason, mismatches, run=False)

    def first(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The first call: served by a saved trace that covers it, else by a new trace."""
        if self.held:
            served = self._take_saved(args, kwargs)
            if served is not None:
                return served[0]
            nearest = self._warm_refused(args, kwargs)
            return self._trace_new(args, kwargs, nearest.words, nearest.mismatches)
        return self._trace_new(args, kwargs, "the first call", [])

    def first_beside(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A cold first call, served eagerly, in its trace thread (api.py): a saved trace that
        covers it (another process saved it since the call looked) serves from now on, nothing
        traced; else the call is traced beside eager."""
        if self.held:
            with self._lock:
                entry = self._adopt_saved(args, kwargs)
                if entry is not None:
                    self._serving(entry)
                    return
            nearest = self._warm_refused(args, kwargs)
            return self.trace_beside(args, kwargs, nearest.words, nearest.mismatches)
        self.trace_beside(args, kwargs, "the first call", [])

    def _warm_refused(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Nearest:
        """Saved traces are there, none for this call: why, said once and kept for the report."""
        counters.bump("warm_start_fallbacks")
        nearest = self._nearest(args, kwargs, among=self.held)
        self.warm_refused = f"this call differs from the saved traces: {nearest.words}"
        log.info("%s: %s; tracing it", self.model.name, self.warm_refused)
        return nearest

    def _trace_new(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str, mismatches: list[Mismatch]
    ) -> Any:
        """A call no entry covers: served eagerly and traced beside it (eager first), else traced."""
        served = self.beside.serve(args, kwargs, reason, mismatches) if self.beside is not None else None
        if served is not None:
            return served[0]
        fleet = self.fetch_fleet(args, kwargs)  # traced on this thread: the fleet's traces first
        if isinstance(fleet, TraceEntry):
            found = self._serve_existing(args, kwargs, among=[fleet])
            assert found is not None, "the fleet's entry was adopted for this call"
            return found[0]
        if fleet is not None:
            reason, mismatches = fleet.words, fleet.mismatches
        return self.trace(args, kwargs, reason, mismatches)

    def trace(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reason: str,
        mismatches: list[Mismatch],
        run: bool = True,
    ) -> Any:
        """Trace this call once more (widening the plan by what changed), add and serve it. A trace
        that fails on the call's values where eager fails too raises eager's error (the caller's).
        ``run=False``: the call is not run (eager served it: beside.py), and the output is None."""
        # A call eager rejects too leaves the plan as it was (no reason to make a dim dynamic).
        undo = functools.partial(setattr, self, "plan", self.plan)
        name, target = self.model.name, self.model.target
        failing = eager_errors_first(name, target, args, kwargs, undo) if run else contextlib.nullcontext()
        with self._lock, failing:
            changed = changed_since_every_entry(self.model.signature, self.entries, args, kwargs)
            names = call_args.argument_names(self.model.signature, args, kwargs)
            self.plan = widened(self.plan, names, [*mismatches, *changed])
            try:
                output = self._trace(args, kwargs, reason, run)
            except SizeFixedError as e:
                # The code fixes the size of a dim marked dynamic: marked "maybe dynamic" from
                # now on, Dynamo keeps it static, and each size it fixes is an entry of its own.
                log.info("%s: %s; its size is traced as the code fixes it", self.model.name, e)
                self.plan = dataclasses.replace(self.plan, soft=True)
                output = self._trace(args, kwargs, reason, run)
            self._retire_widened(mismatches)
            return output

    def _retire_widened(self, mismatches: list[Mismatch]) -> None:
        """The nearest entry held back when the new one only made its sizes dynamic (see
        trace_route.widened_from): the new trace serves its calls, so it no longer counts against
        ``max_traces``. Held, not dropped: a call only it covers takes it back, within the limit."""
        old = widened_from(self.entries, mismatches)
        if old is None:
            return
        new, self.entries = self.entries[-1], tuple(e for e in self.entries if e is not old)
        self.held.append(old)
        if all(e.split_model is not old.split_model for e in self.entries):  # pieces no trace shares
            old.split_model.background.hold_back()  # its compiles go after those of the traces that serve
        self._say(f"{self.model.name}: trace {old.number} held back, trace {new.number} serves its calls")

    def uncovered(self, call: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[str, list[Mismatch]] | None:
        """Why no trace covers a call kept while another was made (beside.py): the reason and
        mismatches to trace it with; None when one covers it, or no more may be made."""
        args, kwargs = call
        with self._lock:
            covered = (self._serve_existing(args, kwargs, among=a, serve=False) for a in (None, self.held))
            if any(covered) or len(self.entries) >= self.config.trace_limit:
                return None
            nearest = self._nearest(args, kwargs)
            return nearest.words, nearest.mismatches

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str, run: bool) -> Any:
        values = bind_arguments(self.model.func, self.model.bound_to, args, kwargs)
        newcomers = [
            d for d in newcomer_dims(self.plan, values, bool(self.entries)) if d not in self.plan.dims
        ]
        if newcomers:
            self.plan = dataclasses.replace(self.plan, dims=(*self.plan.dims, *newcomers))
        choice = self.choose(values)
        if not self.entries:
            self.marked_dims = list(choice.dims)
        oblivious = (
            self.config.dynamic_shapes in ("backed", "backed_size_oblivious") and not self._no_oblivious
        )
        try:
            return self._trace_with(args, kwargs, values, choice, reason, oblivious, run)
        except TracedAtOne as e:
            # This call has a size an op of the graph treats apart (``x.squeeze()`` at 1): traced
            # as Dynamo does by default, which makes sizes 0 and 1 static.
            log.info("%s: %s; traced for that size", self.model.name, e)
            return self._trace_with(args, kwargs, values, choice, reason, False, run)
        except SizeFixedError:
            raise
        except Exception as e:
            if not oblivious or (isinstance(e, TesseraError) and not isinstance(e, UnsupportedModelError)):
                raise
            if hinted(values, choice):
                # A size of 0 or 1 traced with a general hint, where another tensor of the call
                # holds that size static (a decode step's batch of 1 in the cache's tensors): this
                # call is traced for its size; the model's other traces stay size-oblivious.
                log.info("%s: %s; traced for this call's sizes", self.model.name, first_line(e))
                return self._trace_with(args, kwargs, values, choice, reason, False, run)
            # A size-oblivious trace torch cannot make (a kernel's meta function that needs the
            # size): traced as Dynamo does by default, sizes 0 and 1 then get entries of their own.
            # The model's later traces go that way at once (each failed attempt costs a trace).
            log.info(
                "%s: no size-oblivious trace (%s); tracing with sizes >= 2", self.model.name, first_line(e)
            )
            output = self._trace_with(args, kwargs, values, choice, reason, False, run)
            self._no_oblivious = True  # not after a call that fails either way (the caller's error)
            return output

    def _trace_with(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        values: dict[str, Any],
        choice: DynamicChoice,
        reason: str,
        oblivious: bool,
        run: bool,
    ) -> Any:
        context, model = self.context, self.model
        receiver = GraphReceiver.for_trace(self.config, context, self._by_graph)
        start, wall = time.perf_counter(), time.time()
        before = versions(args, kwargs)
        nested = [t for t, _ in nested_tensors(self.plan, args, kwargs)]
        marked = [v for v in values.values() if isinstance(v, torch.Tensor)] + nested
        with COMPILE_LOCK.for_trace(), _compat.dim_marks_restored(marked):
            mode = (
                "backed"
                if self.config.dynamic_shapes == "backed_size_oblivious"
                else self.config.dynamic_shapes
            )
            dropped = functools.partial(setattr, self, "dropped_guards")
            hinted_small = mark_call(
                self.plan, args, kwargs, values, choice, mode, self.mark_nested, oblivious
            )
            trace = trace_once(
                model.traced_fn,
                receiver,
                model.target,
                args,
                kwargs,
                model.func.__qualname__,
                recorder(self.model, args, kwargs, choice, oblivious, hinted_small, dropped),
                self.plan.state,
                size_oblivious=oblivious,
                run=run,
            )
        mutated = changed_arguments(before, args, kwargs)
        tensors = frozenset(n for n, v in values.items() if isinstance(v, torch.Tensor))
        self.plan = dataclasses.replace(self.plan, seen=self.plan.seen | tensors)
        split_model = receiver.received()
        inside = split_model.phases.get("split", 0.0) + split_model.phases.get("compile", 0.0)
        seconds = time.perf_counter() - start - inside
        self.trace_seconds += seconds
        spec: call_check.CallSpec = trace.guards
        if split_model.dumps is not None:
            split_model.dumps.transformed_code(trace.code)
        fast = functools.partial(trace.call, model.target)
        entry = make_entry(
            model,
            context,
            self._next_number(),
            spec,
            fast,
            split_model,
            reason,
            loaded=False,
            code=trace.code,
            mutated=mutated,
            timed=(wall, seconds),
        )
        self._fresh = (entry, threading.get_ident())
        try:
            self.entries = (*self.entries, entry)
            self._serving(entry)
        finally:
            self._fresh = None
        if len(self.entries) > 1:
            self._say(
                f"{model.name}: trace {entry.number} of at most {self.config.trace_limit}, because {reason}"
            )
        shared = next((e for e in self.entries[:-1] if e.split_model is split_model), None)
        if shared is not None:  # the graph of an earlier trace: its pieces serve this one too
            self._say(f"{model.name}: trace {entry.number} has the graph of trace {shared.number}, shared")
            split_model.background.after_ready(functools.partial(self._save, entry))
            return trace.output
        split_model.background.start(functools.partial(self._save, entry))
        if not split_model.background.ready.is_set():
            split_model.artifact_fate = ArtifactFate(ArtifactState.PENDING)
        return trace.output

    def _save(self, entry: TraceEntry) -> None:
        """Once every size of ``entry`` is compiled: its whole-model artifact, for the next process;
        listed as the oldest trace if a later one widened it and serves its calls meanwhile."""
        # Read without the traces' lock: this runs under the compile lock, which a trace takes
        # inside it (the other order deadlocks); the entries are a tuple, replaced whole.
        serving = any(e.split_model is entry.split_model for e in self.entries)
        superseded = not serving and any(h.split_model is entry.split_model for h in list(self.held))
        warm.save_entry(self.context, self.model.traced_fn, entry, plan_to_json(self.plan), superseded)

    def _next_number(self) -> int:
        self._numbered += 1
        return self._numbered

    def choose(self, values: dict[str, Any]) -> DynamicChoice:
        """The dims marked dynamic for a trace of this call (trace_plan.dims_for)."""
        return dims_for(self.plan, self.model.func, values, self.dynamic_dims, self.soft_dims)

    # -- routing --------------------------------------------------------------------------------
    def slow(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call the last entry's quick check did not pass: grad enabled, another entry's call,
        another structure or layout, or one no entry covers (traced, or refused past the limit)."""
        if torch.is_grad_enabled():  # refused, or routed as inference (the one grad policy)
            read = self.last.tensors(args, kwargs) if self.last is not None else ()  # the trace's
            tensors = lambda: itertools.chain(read, grad_tensors((args, kwargs)))  # noqa: E731
            return as_inference(self.model.name, self.model.owner, tensors, lambda: self.route(args, kwargs))
        found = self.shapes.find(args, kwargs)  # a shape served before in another syntax
        if found is not None and any(e is found.entry for e in self.entries):  # not one held back
            self._serving(found.entry)
            return found.entry.fast(*found.args, **found.kwargs)
        beside = self.beside if self.beside is not None and self.beside.busy() else None
        if beside is not None and self.uncovered_calls.known(self.entries, args, kwargs):
            return beside.missed(args, kwargs)  # a trace in flight: it may cover this
        served = self._serve_existing(args, kwargs)
        if served is not None:
            return served[0]
        if beside is not None:
            self.uncovered_calls.add(self.entries, args, kwargs)
            return beside.missed(args, kwargs)
        with self._lock:
            served = self._serve_existing(args, kwargs)  # another thread may have traced it
            if served is None and self.held:
                served = self._take_saved(args, kwargs)
            if served is not None:
                return served[0]
            nearest, reason, mismatches = self._nearest(args, kwargs)
            past_limit = len(self.entries) >= self.config.trace_limit
            if past_limit and self.config.strict_traces:
                limit = self.config.trace_limit
                raise refusal(self.model.name, self.entries, limit, nearest, reason, mismatches)
            if nearest is not None and layout_of_written_input(nearest, mismatches):
                # A model that writes to its input, called with it in another layout: a copy
                # would lose the write, and a trace for that layout is not made (its compiled
                # kernels were seen to assume the first layout). Refused, saying what to pass.
                raise call_check.InputMismatchError(
                    f"{self.model.name}: {reason}; the model writes to this argument, so tessera "
                    "cannot copy it into the traced layout: pass it in that layout (.contiguous())"
                )
            if self.beside is None and not past_limit:
                return self.trace(args, kwargs, reason, mismatches)
        if past_limit:  # eager runs outside the lock
            return self._past_limit(args, kwargs, reason)
        return self._trace_new(args, kwargs, reason, mismatches)

    def _past_limit(self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str) -> Any:
        """A call no trace covers once the model holds its traces (``max_traces`` not given):
        served eagerly, as stock torch.compile serves past its recompile limit, with one warning
        per model naming what changed."""
        if not self._past_limit_said:
            self._past_limit_said = True
            warnings.warn(
                f"{self.model.name}: no trace covers this call ({reason}), and the model holds "
                f"{len(self.entries)} traces, the most it keeps; calls no trace covers are served "
                "eagerly from now on. A value the forward changes on every call (a counter, a "
                "list it appends to) needs a trace per call: keep it out of forward, or give "
                "max_traces to have such calls refused instead",
                TraceLimitWarning,
                stacklevel=2,
            )
        counters.bump("served_eagerly")
        return self.model.target(*args, **kwargs)

    def route(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call from the top: the last entry's check, then the rest."""
        last = self.last
        if last is not None and last.accepts(args, kwargs):
            return last.fast(*args, **kwargs)
        return self.slow(args, kwargs)

    def _serve_existing(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        among: list[TraceEntry] | None = None,
        serve: bool = True,
    ) -> tuple[Any] | None:
        """The output of the entry that covers this call (trace_route.covering); None if none
        does. ``among``: those entries instead of the model's; ``serve=False``: the entry, not run."""
        ordered = self._ordered() if among is None else among
        remember = self.shapes.remember if serve else None
        found = covering(self.model.signature, ordered, args, kwargs, remember)
        if found is None:
            return None
        if not serve:
            return (found.entry,)
        self._serving(found.entry)
        return (found.entry.fast(*found.args, **found.kwargs),)

    def _ordered(self) -> list[TraceEntry]:
        last = self.last
        rest = [e for e in reversed(self.entries) if e is not last]
        return ([last] if last is not None else []) + rest

    def _serving(self, entry: TraceEntry) -> None:
        fresh = self._fresh
        if fresh is not None and fresh[0] is entry and fresh[1] != threading.get_ident():
            # Made beside eager, and not yet installed by its trace's thread (which may be paced
            # at this very call, waiting for the call that found it): the call runs it, and the
            # check's build and the first trace's report stay off the served call.
            return
        if entry is not self.last:
            self.last = entry
            self._install(entry)

    def _nearest(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], among: list[TraceEntry] | None = None
    ) -> Nearest:
        """The entry this call differs least from, in words, and the assumptions it breaks."""
        return nearest(self.model.signature, self._ordered() if among is None else among, args, kwargs)

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.info("%s", message)

    # -- what the face reports ------------------------------------------------------------------
    def split_models(self) -> list[SplitModel]:
        return [e.split_model for e in self.entries]

    def spans(self) -> list[TraceSpan]:
        """Each trace made in this process."""
        return [TraceSpan(f"trace {e.number}", e.started, e.seconds) for e in self.entries if not e.loaded]

    # -- the traces earlier processes saved ------------------------------------------------------
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
