"""``tessera.compile`` and the ``CompiledModel`` it returns: the public face.

Chooses the mode's path (none / stock / trace_once / piecewise) at the first call. The model's
traces are owned by ``traces.Traces`` (made, loaded from the warm start, routed, bounded); this
module runs the root module's hooks around them and keeps the record of the first call.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import threading
import time
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tessera import counters, validation
from tessera.cache.root import nothing_saved
from tessera.compilation.compilers import check_backend, stock_backend
from tessera.config import CompileConfig, checked_config
from tessera.errors import UnsupportedModelError, first_line
from tessera.lifecycle import Lifecycle, Stage
from tessera.serving.acyclic import weakly
from tessera.trace import hooks
from tessera.trace.beside import Beside, eager_first
from tessera.trace.grad import as_inference, grad_tensors
from tessera.trace.wrapper import DynamicDims, bind_arguments, entry_frame, split_callable

# The traces, the compile and the report are imported where first used: a cold first call is
# served eagerly before any of them is needed, and its trace thread imports them (_first_beside).
if TYPE_CHECKING:
    from tessera.compilation.piece import PieceRecord
    from tessera.report import CompileReport, GuardedGraph
    from tessera.serving.split_model import SplitModel
    from tessera.trace import call_check
    from tessera.trace.assumption import Mismatch
    from tessera.trace.beside import Tracer
    from tessera.trace.trace_entry import TraceEntry
    from tessera.trace.traces import Traces

log = logging.getLogger(__name__)

# ``tessera report SCRIPT`` / ``tessera bisect SCRIPT`` set this to a list: every compiled model
# is appended, and keeps its first call's arguments (first_call) for bisection.
RECORDER: list[CompiledModel] | None = None


def compile(
    model: Callable[..., Any],
    config: CompileConfig | None = None,
    *,
    dynamic_dims: DynamicDims | None = None,
    prefix: str | None = None,
    on_compiled: Callable[[CompileReport], Any] | None = None,
    **overrides: Any,
) -> CompiledModel:
    """Compile ``model`` (an ``nn.Module`` or a function) for fast repeated inference.

    Nothing is traced until the first call; keyword ``overrides`` replace ``config`` fields.
    ``on_compiled(report)`` is called once, when the first call has compiled or loaded everything.
    Every argument is checked here: a bad one is a ``ConfigError`` now, not at the first call.
    """
    config = checked_config(config, overrides, prefix, dynamic_dims, on_compiled)
    check_backend(config)  # a custom compiler that does not import fails here, not at the first call
    validation.warn_if_untested_torch()
    compiled = CompiledModel(model, config, dynamic_dims, prefix, on_compiled)
    if dynamic_dims is not None:
        validation.check_dynamic_dim_names(compiled.signature, dynamic_dims)
    return compiled


def _returning_compiled(
    method: Callable[..., Any], model: Any, compiled: CompiledModel
) -> Callable[..., Any]:
    """The model's own method, returning the compiled model where it returns the model: the
    chained ``tessera.compile(m).eval()``, ``.to(torch.float64)``, ``.half()`` keep serving
    through tessera (whose call check sees what they changed, as for any call)."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        return compiled if result is model else result

    return call


def _compiled_again(
    model: Callable[..., Any], config: CompileConfig, dynamic_dims: DynamicDims | None, prefix: str | None
) -> CompiledModel:
    """What an unpickled compiled model becomes: the model compiled again with its settings."""
    return CompiledModel(model, config, dynamic_dims, prefix)


class CompiledModel:
    """Same call signature and results as the model; ``pieces`` and ``cache_dir`` tell the rest."""

    def __init__(
        self,
        model: Callable[..., Any],
        config: CompileConfig,
        dynamic_dims: DynamicDims | None,
        prefix: str | None,
        on_compiled: Callable[[CompileReport], Any] | None = None,
    ) -> None:
        self.model, self._on_compiled, self.prefix = model, on_compiled, prefix
        self.compile_config = config  # tessera's; `.config` reads the model's (a diffusers pipeline does)
        self._func, self._bound_to = split_callable(model)
        self._module = model if isinstance(model, torch.nn.Module) else None
        # What the traced frame calls: the forward itself, so root hooks stay ours to run.
        self._target: Callable[..., Any] = model.forward if isinstance(model, torch.nn.Module) else model
        self._traced_fn = entry_frame()
        self._dynamic_dims = dynamic_dims
        # Re-entrant: a call that waited for the first call's compile is served under the lock,
        # and may need a trace of its own, which takes it again.
        self._lock = threading.RLock()
        self._life = Lifecycle(Stage.UNBUILT, weakly(self._first_call))
        self.first_call_seconds: float | None = None
        self.warm_start: bool | None = None  # True: every trace the first call needed was loaded
        self.startup_phases: dict[str, float] = {}  # seconds per phase of the first call
        self._counters: tuple[tuple[str, int], ...] = ()  # this model's counters (first call)
        self._traces: Traces | None = None  # every trace of the model (traces.py)
        self._calls: dict[int, tuple[TraceEntry, Callable[..., Any]]] = {}  # each entry's call, built once
        # The guarded path (graph breaks): each graph Dynamo made, and the split_model that compiled it.
        self._graphs: list[GuardedGraph] = []
        self.first_call: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # kept when recording
        # Set by presets (tessera.hf): dims marked "maybe dynamic" (Dynamo keeps them static where
        # the code fixes them), and a function marking dims of tensors nested in the arguments.
        self._soft_dims = False
        self._mark_nested: Callable[[dict[str, Any]], None] | None = None
        self._served_eagerly = False  # the first call was served eagerly, its trace made beside it
        self._counted_from: dict[str, int] = {}  # the counters when the first call started
        self._guarded_reason: str | None = None  # the trace beside eager found graph breaks
        self._beside: Beside | None = None  # eager serving and the trace beside it (eager first)
        self._cold_failed = False  # the traces of a cold first call could not be made beside it
        if RECORDER is not None:
            RECORDER.append(self)

    def use_preset(self, soft_dims: bool, mark_nested: Callable[[dict[str, Any]], None] | None) -> None:
        """How a preset (tessera.hf) traces this model: ``soft_dims``, its dynamic dims are
        suggestions ("maybe dynamic"); ``mark_nested``, marks it adds to each call's values."""
        self._soft_dims, self._mark_nested = soft_dims, mark_nested

    def __getattr__(self, name: str) -> Any:
        # Called only for names CompiledModel lacks: the model's own (``unet.config``,
        # ``.dtype``, ``.device``), as code that held the model reads them (a diffusers pipeline).
        model = self.__dict__.get("model")
        if model is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = getattr(model, name)
        if inspect.ismethod(value) and value.__self__ is model:
            return _returning_compiled(value, model, self)
        return value

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledModel:
        """A compiled copy of a copy of the model: traced or loaded again at its first call (the
        cache makes that a warm start), with the same settings. The traces, threads and locks of
        this one are not copied."""
        return self._again(copy.deepcopy(self.model, memo))

    def __copy__(self) -> CompiledModel:
        """Another compiled model over the same model (its own traces, the same settings)."""
        return self._again(self.model)

    def __reduce__(self) -> Any:
        """Pickled as the model and the settings; compiled again where it is loaded."""
        return (_compiled_again, (self.model, self.compile_config, self._dynamic_dims, self.prefix))

    def _again(self, model: Callable[..., Any]) -> CompiledModel:
        config, dims, on_compiled = self.compile_config, self._dynamic_dims, self._on_compiled
        compiled = CompiledModel(model, config, dims, self.prefix, on_compiled)
        compiled.use_preset(self._soft_dims, self._mark_nested)
        return compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Dynamo is tracing this call: the model is called inside a torch.compile'd function,
            # inside another tessera model, or by itself (recursion). The outer trace owns it:
            # it inlines the model, as torch.compile inlines a nested compiled function.
            return self.model(*args, **kwargs)
        return self._life.call(*args, **kwargs)

    # -- what a user reads --------------------------------------------------------------------------
    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The call signature of the model (its forward without ``self``)."""
        signature = inspect.signature(self._func)
        if self._bound_to is not None:
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        return signature

    @property
    def __signature__(self) -> inspect.Signature:
        """What ``inspect.signature(compiled)`` gives: the model's, so callers that read it (Hugging
        Face ``generate()`` checks which keywords ``forward`` takes) see the real parameters."""
        return self.signature

    @property
    def name(self) -> str:
        return self.prefix or self._func.__qualname__

    @property
    def report(self) -> CompileReport | None:
        """What the first call compiled or loaded, from where, at what cost (None before it, and
        while calls are served eagerly before the first trace serves)."""
        if self.first_call_seconds is None or self._life.stage is Stage.EAGER:
            return None
        return self._make_report()

    @property
    def ready(self) -> bool:
        """Whether every compile size and range is in place (compiled in the background after the
        first output, see ``CompileConfig.background_compile``). False before the first call."""
        return self.wait_ready(0)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every size of every trace is in place (and a size being learnt from traffic
        is compiled), at most ``timeout`` seconds; whether it is. A server gates its readiness on
        it; calls are served (by the general artifacts) meanwhile. False at once before the first
        call (nothing is traced to wait for); on the guarded path, the graphs reached so far."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.wait_traced(timeout):
            return False
        for split_model in self._split_models():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not split_model.background.ready.wait(left):
                return False
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not split_model.learning.idle.wait(left):  # a size learnt from traffic, compiling
                return False
        return self.first_call_seconds is not None

    def wait_traced(self, timeout: float | None = None) -> bool:
        """Wait until no trace is being made beside eager (the calls served eagerly meanwhile are
        then served by the traces that cover them), at most ``timeout`` seconds; whether so."""
        beside = self._beside
        return beside is None or beside.landed.wait(timeout)

    def _split_models(self) -> list[SplitModel]:
        own = self._traces.split_models() if self._traces is not None else []
        return own + [g.split_model for g in self._graphs]

    def _make_report(self) -> CompileReport:
        from tessera.report import model_report

        return model_report(
            self.name,
            self.compile_config,
            self._split_model,
            self._graphs,
            self._traces,
            dict(self.startup_phases),
            self._counters,
            self.first_call_seconds or 0.0,
        )

    @property
    def entry_frame(self) -> types.FunctionType:
        """The frame tessera traces (it calls ``target``)."""
        return self._traced_fn

    # -- the first call ----------------------------------------------------------------------------
    def _first_call(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._life.stage in (Stage.READY, Stage.EAGER):  # another thread made the first call
                return self._life.call(*args, **kwargs)
            module = self._module
            # The trace sees what the pre-hooks make of the call (stock and none: torch runs them).
            traced = self.compile_config.mode in ("trace_once", "piecewise")
            first = hooks.around(module, self._compile_first) if traced else self._compile_first
            return first(*args, **kwargs)

    def _compile_first(self, *args: Any, **kwargs: Any) -> Any:
        if RECORDER is not None:  # kept for bisection: a copy, since the caller may reuse its buffers
            try:
                self.first_call = copy.deepcopy((args, dict(kwargs)))
            except Exception as e:  # an argument that cannot be copied: keep what was passed
                log.info("%s: first call kept by reference for bisection (%s)", self.name, e)
                self.first_call = (args, dict(kwargs))
        start = time.perf_counter()
        self._counted_from = counters.snapshot()
        unbuilt = self._life
        self._served_eagerly = False  # set again by _compile where eager serves this call
        self._move(stage=Stage.TRACING)
        try:
            output, call = self._compile(args, kwargs)
        except BaseException:
            self._life = unbuilt  # the next call tries again
            raise
        if call is not None:  # a path without traces (none, stock, guarded), or eager first
            self._move(call=call)
        self.first_call_seconds = time.perf_counter() - start
        if self._served_eagerly:  # the report once the trace made beside it serves (_install)
            self._move(stage=Stage.EAGER)
            return output
        self._move(stage=Stage.READY)
        self._first_reported()
        return output

    def _first_reported(self) -> None:
        """The first call's report: logged, saved with the cache entry, given to ``on_compiled``."""
        from tessera.report import counter_delta, publish

        self._counters = counter_delta(self._counted_from, counters.snapshot())
        report = self._make_report()
        log.info("%s", report.summary())  # one line per model: cold or warm, cost, where
        publish(report, self.cache_dir, weakly(self._make_report), self._on_compiled)

    def _move(self, **changes: Any) -> None:
        """The next lifecycle record: this one with ``changes``, swapped in whole."""
        self._life = dataclasses.replace(self._life, **changes)

    def _compile(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Callable[..., Any] | None]:
        """The first call's output, and what serves later calls (None: the traces, installed)."""
        mode = self.compile_config.mode
        if mode == "none":
            return self.model(*args, **kwargs), self.model
        if mode != "stock" and torch.is_grad_enabled():
            # tessera compiles inference graphs: refuse now a call whose result needs gradients,
            # and trace (or start warm) under no_grad a call whose result would not.
            return as_inference(
                self.name,
                self._owner(),
                lambda: grad_tensors((self.model, args, kwargs)),
                lambda: self._compile(args, kwargs),
            )
        values = bind_arguments(self._func, self._bound_to, args, kwargs)
        if self._guarded_reason is not None:  # found by the trace made beside eager
            return self._start_guarded(args, kwargs, values, self._guarded_reason)
        if mode == "stock":
            from tessera.trace.wrapper import choose_dynamic_dims, mark_dynamic

            mark_dynamic(values, choose_dynamic_dims(self._func, values, self._dynamic_dims))
            compiled = torch.compile(self.model, backend=stock_backend(self.compile_config.backend))
            return compiled(*args, **kwargs), compiled
        if eager_first(self.compile_config) and not self._cold_failed and nothing_saved(self.compile_config):
            served = self._serve_cold(args, kwargs)
            if served is not None:
                return served
        traces = self._traces = self._make_traces()
        traces.soft_dims, traces.mark_nested = self._soft_dims, self._mark_nested
        if eager_first(self.compile_config):
            traces.beside = self._beside = self._new_beside(traces.trace_beside)
            traces.beside.uncovered = traces.uncovered
        other = traces.load_saved()
        if other is not None:  # recorded by an earlier process: graph breaks
            log.info("%s: %s (recorded by an earlier process)", self.name, other)
            return self._start_guarded(args, kwargs, values, other.reason)
        try:
            output = traces.first(args, kwargs)
        except UnsupportedModelError as e:
            if self.compile_config.fullgraph or e.dynamo_error is None:
                raise
            from tessera.trace.guarded import record_guarded

            record_guarded(self._traces.context if self._traces is not None else None, self.name, str(e))
            return self._start_guarded(args, kwargs, values, str(e))
        if not traces.entries and traces.beside is not None:  # served eagerly: traced beside
            self._served_eagerly = True
            return output, hooks.around(self._module, weakly(self._eager_stage))
        self._first_traced(traces)
        return output, None

    def _first_traced(self, traces: Traces) -> None:
        """What the first trace cost, once it serves."""
        # Warm: a saved trace served the first call, and nothing was traced for it.
        self.warm_start = bool(traces.entries) and all(e.loaded for e in traces.entries)
        served = traces.last
        if served is not None:
            self.startup_phases.update(served.split_model.phases)
        if traces.trace_seconds:
            self.startup_phases["trace"] = traces.trace_seconds

    # -- eager first (beside.py) --------------------------------------------------------------------
    def _new_beside(self, trace: Tracer) -> Beside:
        beside = Beside(self.name, self._target, trace)
        beside.on_failure = weakly(self._trace_beside_failed)
        beside.owner = weakref.ref(self)
        return beside

    def _serve_cold(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Callable[..., Any]] | None:
        """A cold first call: eager's output at once, the traces made (and imported: tens of ms) by the
        trace thread beside it (``_first_beside``). None: the call cannot be
        traced in another thread; the usual path traces it here."""
        beside = self._beside = self._new_beside(weakly(self._first_beside))
        served = beside.serve(args, kwargs, "the first call", [])
        if served is None:
            self._beside = None
            return None
        self._served_eagerly = True
        return served[0], hooks.around(self._module, weakly(self._eager_stage))

    def _first_beside(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str, mismatches: list[Mismatch]
    ) -> None:
        """The trace thread of a cold first call: the model's traces made, then the call traced
        (the fleet's traces first, as any trace beside eager)."""
        beside = self._beside
        assert beside is not None, "set before the trace thread starts"
        try:
            traces = self._make_traces()
            other = traces.load_saved()  # saved by another process since the first call looked
        except Exception as e:  # the cache or the fleet's settings: the caller's error, as before
            log.debug("%s: the traces could not be made beside eager (%s)", self.name, first_line(e))
            with self._lock:  # after the first call's own lifecycle moves
                self._cold_failed = True  # the next call takes the usual path, and raises it
                self._life = Lifecycle(Stage.UNBUILT, weakly(self._first_call))
            return
        traces.soft_dims, traces.mark_nested = self._soft_dims, self._mark_nested
        traces.beside = beside
        beside.tracer = traces.trace_beside  # the calls kept meanwhile, and later misses
        beside.uncovered = traces.uncovered  # (each traced if no trace covers it)
        self._traces = traces  # later calls are routed by the traces from here
        if other is not None:  # a path recorded by an earlier process: graph breaks
            log.info("%s: %s (recorded by an earlier process)", self.name, other)
            beside.failure = UnsupportedModelError(other.reason)  # the calls kept are not traced
            self._guarded_next(other.reason)
            return
        traces.first_beside(args, kwargs)

    def _eager_stage(self, *args: Any, **kwargs: Any) -> Any:
        """A call before the first trace serves: eagerly (the traces route it once one does)."""
        traces, beside = self._traces, self._beside
        if traces is not None:
            serve = functools.partial(traces.slow, args, kwargs)
        else:  # a cold first call's trace thread has not made the traces yet: kept, served eagerly
            assert beside is not None, "eager first serves a model with a trace beside it"
            serve = functools.partial(beside.missed, args, kwargs)
        if torch.is_grad_enabled():  # the grad policy of a traced call, the model's own included
            return as_inference(
                self.name, self._owner(), lambda: grad_tensors((self.model, args, kwargs)), serve
            )
        return serve()

    def _trace_beside_failed(self, error: BaseException) -> None:
        """The trace made beside eager failed: graph breaks take the guarded path at the next call
        (as at a first call); any other failure leaves the calls no trace covers to eager."""
        traces = self._traces
        first = self._life.stage is Stage.EAGER
        if first and isinstance(error, UnsupportedModelError) and error.dynamo_error is not None:
            from tessera.trace.guarded import record_guarded

            record_guarded(traces.context if traces is not None else None, self.name, str(error))
            self._guarded_next(str(error))
            return
        log.warning(
            "%s: %s cannot be traced (%s); served eagerly",
            self.name,
            "the model" if first else "a call no trace covers",
            first_line(error),
        )

    def _guarded_next(self, reason: str) -> None:
        """Graph breaks: the next call starts again, on the guarded path (as a first call would)."""
        self._guarded_reason = reason
        self._life = Lifecycle(Stage.UNBUILT, weakly(self._first_call))

    def _owner(self) -> Any:
        return self._module if self._module is not None else self._bound_to

    def _make_traces(self) -> Traces:
        from tessera.trace.trace_entry import Model, TraceContext
        from tessera.trace.traces import Traces

        config = self.compile_config
        context = TraceContext.open(
            config,
            self._func,
            self._bound_to,
            self._dynamic_dims,
            self.prefix,
            self.startup_phases,
            defer_fetch=eager_first(config),  # the store is asked beside eager's first output
        )
        model = Model(
            self.name,
            self._func,
            self._bound_to,
            self._target,
            self._traced_fn,
            self.signature,
            self._owner(),
        )
        # Weakly: a cycle back to this model would keep it after the service drops it (acyclic.py).
        return Traces(model, config, context, self._dynamic_dims, weakly(self._install), self._lock)

    def _install(self, entry: TraceEntry) -> None:
        """Every later call: root hooks as in eager, ``entry``'s check, then its forward; a call
        the check refuses goes to the traces (another entry, or a new trace)."""
        traces = self._traces
        assert traces is not None, "installed by the traces"
        built = self._calls.get(id(entry))
        if built is not None and built[0] is entry:  # built once per entry: a switch back is cheap
            self._move(call=built[1], spec=entry.spec)
            return
        from tessera.trace import call_check

        checked = (
            call_check.make_checked_call(entry.spec, entry.fast, traces.slow, entry.bound)
            if self.compile_config.check_inputs
            else entry.fast
        )
        call = hooks.around(self._module, checked)
        self._calls[id(entry)] = (entry, call)
        self._move(call=call, spec=entry.spec)
        if self._life.stage is Stage.EAGER:  # the first trace, made beside eager, serves now
            self._first_traced(traces)
            self._move(stage=Stage.READY)
            self._first_reported()

    def _start_guarded(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], values: dict[str, Any], reason: str
    ) -> tuple[Any, Callable[..., Any]]:
        from tessera.trace.guarded import start_guarded

        assert self._traces is not None
        choice = self._traces.choose(values)
        output, call, seconds = start_guarded(
            self.name,
            self.compile_config,
            self.prefix or "model",
            self._target,
            self._module,
            (args, kwargs, values),
            choice,
            reason,
            self._graphs,
        )
        self.startup_phases["trace_and_compile"] = seconds
        return output, call

    # -- what a user reads of a compiled model: its stage, traces, pieces, cache entry, call check --
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
