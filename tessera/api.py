"""``tessera.compile`` and the ``CompiledModel`` it returns: the public entry point.

Chooses the mode's path (none / stock / trace_once / piecewise), runs the first call (a warm start
from the whole-model artifact when there is one, else the one Dynamo trace) and puts every later
call behind the check of what that trace assumed (call_check.py) and the root module's hooks.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import inspect
import json
import logging
import re
import threading
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tessera import _compat, call_check, counters, dynamo_guards, hooks, validation
from tessera.backend import GraphReceiver, PiecewiseBackend
from tessera.cache import artifact as model_artifact
from tessera.cache.artifact import WarmStartUnavailable
from tessera.cache.entry import cache_root, rank_dir
from tessera.cache.key import fingerprint_record
from tessera.cache.remote import RemoteTier, fetch_pointer, publish, remote_tier
from tessera.compile_state import COMPILE_LOCK, between_compiles
from tessera.compilers import check_backend, make_compiler, stock_backend, warm_hash
from tessera.config import CompileConfig
from tessera.errors import (
    ConfigError,
    SizeFixedError,
    TesseraWarning,
    UnsupportedModelError,
    UntestedTorchWarning,
)
from tessera.piece import PieceRecord
from tessera.report import (
    CompileReport,
    GraphReport,
    build_report,
    counter_delta,
    merge_graph_reports,
    save_report,
)
from tessera.wrapper import (
    DynamicChoice,
    DynamicDims,
    bind_arguments,
    choose_dynamic_dims,
    entry_frame,
    mark_dynamic,
    split_callable,
    trace_once,
)

log = logging.getLogger(__name__)

# ``tessera report SCRIPT`` / ``tessera bisect SCRIPT`` set this to a list: every compiled model
# is appended, and keeps its first call's arguments (first_call) for bisection.
RECORDER: list[CompiledModel] | None = None

# Argument state (a StaticCache's length) may turn symbolic this many times before calls whose
# state differs are refused: each re-trace costs a compile.
MAX_STATE_RETRACES = 2
# Sizes traced one by one where the code fixes a dynamic dim's size; Dynamo's recompile limit.
MAX_SIZE_TRACES = 8


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
    if on_compiled is not None and not callable(on_compiled):
        raise ConfigError(f"on_compiled={on_compiled!r} must be a callable taking the compile report")
    if config is not None and not isinstance(config, CompileConfig):
        raise ConfigError(f"config={config!r} must be a tessera.CompileConfig (or None)")
    config = (config or CompileConfig()).replace(**overrides)
    if prefix is not None and (
        not isinstance(prefix, str) or not prefix or "/" in prefix or "\\" in prefix or prefix.startswith(".")
    ):
        raise ConfigError(f"prefix={prefix!r} must be a plain directory name such as 'backbone'")
    validation.check_dynamic_dims(dynamic_dims)
    if config.passes and config.backend == "eager":
        raise ConfigError(
            "passes run on Inductor's post-grad graph: use backend='inductor' (the eager compiler "
            "compiles nothing), or a custom compiler that applies config.passes itself"
        )
    if config.backend == "inductor" or config.mode == "stock":
        validation.check_inductor_keys(config.inductor_config)
    check_backend(config)  # a custom compiler that does not import fails here, not at the first call
    _warn_if_untested_torch()
    compiled = CompiledModel(model, config, dynamic_dims, prefix, on_compiled)
    if dynamic_dims is not None:
        validation.check_dynamic_dim_names(compiled.signature, dynamic_dims)
    return compiled


@functools.cache
def _warn_if_untested_torch() -> None:
    """Once per process: a torch outside the tested range installs and runs, with a warning."""
    reason = _compat.untested_torch()
    if reason is not None:
        warnings.warn(reason, UntestedTorchWarning, stacklevel=3)


class Stage(enum.Enum):
    """Where a compiled model is in its life (``compiled.stage``)."""

    UNBUILT = "unbuilt"  # no general trace yet (none, or only small-size children, served calls)
    TRACING = "tracing"  # the first call is loading or tracing and compiling
    READY = "ready"  # later calls go through the call check to what was installed
    RETRACING = "retracing"  # argument state the trace read changed: one more trace


@dataclasses.dataclass(frozen=True)
class Lifecycle:
    """Where a compiled model is in its life and what serves its calls, replaced whole at each
    transition (a reader sees one consistent record, never half of two)."""

    stage: Stage
    call: Callable[..., Any]  # what ``compiled(...)`` runs: root hooks, the call check, the forward
    checked: Callable[..., Any] | None = None  # the call check and the forward (root hooks aside)
    fast: Callable[..., Any] | None = None  # the compiled forward, unchecked
    spec: call_check.CallSpec | None = None  # what the trace assumed of every call
    backend: PiecewiseBackend | None = None  # the pieces of the one trace (None: other paths)


@dataclasses.dataclass(frozen=True)
class TraceContext:
    """What a trace of this model needs, found at the first call: compiler, cache root and
    prefix, the model's fingerprint (None: no whole-model artifact) and the remote tier."""

    compiler: Any
    root: Path | None
    prefix: str
    fingerprint: str | None
    remote: RemoteTier | None


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
        self.model = model
        self._on_compiled = on_compiled
        self.compile_config = config  # tessera's; `.config` reads the model's (a diffusers pipeline does)
        self.prefix = prefix
        self._func, self._bound_to = split_callable(model)
        self._module = model if isinstance(model, torch.nn.Module) else None
        # What the traced frame calls: the forward itself, so root hooks stay ours to run.
        self._target: Callable[..., Any] = model.forward if isinstance(model, torch.nn.Module) else model
        self._traced_fn = entry_frame()
        self._dynamic_dims = dynamic_dims
        # Re-entrant: a call that waited for the first call's compile is served under the lock,
        # and may need a re-trace or a small-size child, which take it again.
        self._lock = threading.RLock()
        self._life = Lifecycle(Stage.UNBUILT, self._first_call)
        self.marked_dims: list[tuple[str, int]] = []
        self.first_call_seconds: float | None = None
        self.warm_start: bool | None = None  # True: rebuilt from the whole-model artifact
        self.warm_start_refused: str | None = None  # why the whole-model artifact was not used
        self.startup_phases: dict[str, float] = {}  # seconds per phase of the first call
        self._counters_before: dict[str, int] = {}
        self._counters: tuple[tuple[str, int], ...] = ()  # this model's counters (first call)
        self._small_before_general = 0  # calls served by small-size children before the general trace
        self.eager_calls = 0  # calls run eagerly past MAX_SIZE_TRACES (code that fixes sizes)
        self._per_size = False  # the code fixes a dynamic dim's size: each size has its own trace
        self._marked_paths: dict[str, frozenset[int]] = {}  # args[i] / kwargs['k'] -> dims marked
        # The guarded path (graph breaks): each graph Dynamo made, and the backend that compiled it.
        self._graphs: list[tuple[GraphReport, PiecewiseBackend]] = []
        self._context = TraceContext(None, None, "model", None, None)
        self._dynamic_state: tuple[str, ...] = ()  # argument ints traced as symbols (see call_check.py)
        self._state_retraces = 0
        self._trace_code: types.CodeType | None = None
        self._bound: dict[str, Any] = {}  # what the call check reads besides the arguments
        self._tensors: Callable[..., tuple[Any, ...]] = lambda args, kwargs: ()  # tensors the trace read
        self._mutated: frozenset[tuple[str, str]] = frozenset()  # top-level arguments the model writes to
        self.dropped_guards: tuple[tuple[str, int], ...] = ()  # Dynamo guards not re-checked, and why
        self.first_call: tuple[tuple[Any, ...], dict[str, Any]] | None = None  # kept when recording
        # Dims held static at a size below Dynamo's floor of 2 (a model serving such calls for its
        # parent), and the children serving this model's calls under the floor, by (name, dim, size).
        self._static_dims: frozenset[tuple[str, int]] = frozenset()
        self._small: dict[frozenset[tuple[str, int, int]], CompiledModel] = {}
        self._accepts: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None
        # Set by wrappers (tessera.hf): dims marked "maybe dynamic" (Dynamo keeps them static where
        # the code fixes them), and a function marking dims of tensors nested in the arguments.
        self._name: str | None = None  # a small-size or per-size child: its parent's name and size
        self._soft_dims = False
        self._mark_nested: Callable[[dict[str, Any]], None] | None = None
        if RECORDER is not None:
            RECORDER.append(self)

    def __getattr__(self, name: str) -> Any:
        # Called only for names CompiledModel lacks: the model's own (``unet.config``,
        # ``.dtype``, ``.device``), as code that held the model reads them (a diffusers pipeline).
        model = self.__dict__.get("model")
        if model is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            # Dynamo is tracing this call: the model is called inside a torch.compile'd function,
            # inside another tessera model, or by itself (recursion). The outer trace owns it:
            # it inlines the model, as torch.compile inlines a nested compiled function.
            return self.model(*args, **kwargs)
        return self._life.call(*args, **kwargs)

    @property
    def stage(self) -> Stage:
        """Where this model is in its life: unbuilt, tracing, ready or retracing."""
        return self._life.stage

    @property
    def call_spec(self) -> call_check.CallSpec | None:
        """What the trace assumed of every call (None before the first trace, or on other paths)."""
        return self._life.spec

    @property
    def _backend(self) -> PiecewiseBackend | None:
        return self._life.backend

    def _move(self, **changes: Any) -> None:
        """The next lifecycle record: this one with ``changes``, swapped in whole."""
        self._life = dataclasses.replace(self._life, **changes)

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
        return self._name or self.prefix or self._func.__qualname__

    @property
    def pieces(self) -> tuple[PieceRecord, ...]:
        """One frozen record per piece (empty before the first call and in modes without pieces)."""
        return () if self._backend is None else self._backend.pieces()

    @property
    def cache_dir(self) -> Path | None:
        """Where this model's artifacts live; None when the cache is disabled or not yet used."""
        backend = self._graphs[0][1] if self._graphs else self._backend
        return backend.entry.path if backend is not None and backend.entry is not None else None

    @property
    def report(self) -> CompileReport | None:
        """What the first call compiled or loaded, from where, at what cost (None before it).
        Until a call has a size the general trace can come from, the first small-size trace's."""
        if self.first_call_seconds is None:
            children = [c.report for c in tuple(self._small.values())]
            return next((r for r in children if r is not None), None)
        return self._make_report()

    @property
    def ready(self) -> bool:
        """Whether every compile size and range is in place (compiled in the background after the
        first output, see ``CompileConfig.background_compile``). False before the first call."""
        return self.wait_ready(0)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait until every size is in place, at most ``timeout`` seconds; whether it is. A
        server gates its readiness on it; calls are served (by the general artifacts) meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for backend in self._backends():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not backend.ready.wait(left):
                return False
        return self.first_call_seconds is not None or bool(self._small)

    def _backends(self) -> list[PiecewiseBackend]:
        own = [self._backend] if self._backend is not None else []
        graphs = [b for _, b in self._graphs]
        children = [b for c in tuple(self._small.values()) for b in c._backends()]
        return own + graphs + children

    def _make_report(self) -> CompileReport:
        if self._graphs:  # the guarded path: one report of every graph's pieces
            return merge_graph_reports(
                [
                    build_report(self.name, self.compile_config, b, {}, self._counters, 0.0)
                    for _, b in self._graphs
                ],
                tuple(r for r, _ in self._graphs),
                dict(self.startup_phases),
                self.first_call_seconds or 0.0,
            )
        return build_report(
            self.name,
            self.compile_config,
            self._backend,
            dict(self.startup_phases),
            self._counters,
            self.first_call_seconds or 0.0,
        )

    @property
    def runners(self) -> dict[str, Any]:
        """Compiled piece name -> its runner (what the split module calls for it)."""
        return dict(self._backend.runners) if self._backend is not None else {}

    @property
    def trace_code(self) -> types.CodeType | None:
        """Dynamo's transformed code of the traced frame (None after a warm start)."""
        return self._trace_code

    @property
    def check_namespace(self) -> dict[str, Any]:
        """What the call check reads besides the arguments (the model, the objects it holds)."""
        return dict(self._bound)

    @property
    def entry_frame(self) -> types.FunctionType:
        """The frame tessera traces (it calls ``target``)."""
        return self._traced_fn

    @property
    def target(self) -> Callable[..., Any]:
        """What the traced frame calls: the model's forward."""
        return self._target

    @property
    def dynamic_dims(self) -> DynamicDims | None:
        return self._dynamic_dims

    @property
    def split_graph(self) -> torch.fx.GraphModule | None:
        """The split module (pieces as submodules), after a traced first call in piecewise modes."""
        return self._backend.split_gm if self._backend is not None else None

    # -- the first call ----------------------------------------------------------------------------
    def _first_call(self, *args: Any, **kwargs: Any) -> Any:
        if self._small and (self._module is None or not hooks.active(self._module)):
            child = self._small_child(args, kwargs)  # small sizes only so far: no lock, no binding
            if child is not None:
                return child(*args, **kwargs)
        with self._lock:
            if self._life.stage is Stage.READY:  # another thread compiled while we waited
                return self._life.call(*args, **kwargs)
            module = self._module
            # The trace sees what the pre-hooks make of the call (stock and none: torch runs them).
            traced = self.compile_config.mode in ("trace_once", "piecewise")
            if module is not None and traced and hooks.active(module):
                return hooks.call_with_hooks(module, self._compile_first, args, kwargs)
            return self._compile_first(*args, **kwargs)

    def _compile_first(self, *args: Any, **kwargs: Any) -> Any:
        if RECORDER is not None:  # kept for bisection: a copy, since the caller may reuse its buffers
            try:
                self.first_call = copy.deepcopy((args, dict(kwargs)))
            except Exception as e:  # an argument that cannot be copied: keep what was passed
                log.info("%s: first call kept by reference for bisection (%s)", self.name, e)
                self.first_call = (args, dict(kwargs))
        start = time.perf_counter()
        self._counters_before = counters.snapshot()
        unbuilt = self._life
        self._move(stage=Stage.TRACING)
        try:
            output, call = self._compile(args, kwargs)
        except BaseException:
            self._life = unbuilt  # the next call tries again
            raise
        if call is None:  # served by a small-size child: the general trace waits for its size
            self._life = unbuilt
            return output
        self._move(stage=Stage.READY, call=call)
        self.first_call_seconds = time.perf_counter() - start
        self._counters = counter_delta(self._counters_before, counters.snapshot())
        report = self._make_report()
        log.info("%s", report.summary())  # one line per model: cold or warm, cost, where
        as_json = json.dumps(report.as_dict(), indent=1)
        _compat.trace_artifact("tessera_compile_report", lambda: as_json, in_compile=False)
        if self.cache_dir is not None:
            save_report(self.cache_dir, report.kind, as_json)
        if self._on_compiled is not None:
            self._on_compiled(report)
        return output

    def _compile(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Callable[..., Any] | None]:
        """The first call's output and the callable for later calls (None: compile deferred)."""
        mode = self.compile_config.mode
        if mode == "none":
            return self.model(*args, **kwargs), self.model
        values = bind_arguments(self._func, self._bound_to, args, kwargs)
        choice = self._choose(values)
        self.marked_dims = list(choice.dims)
        if mode != "stock" and torch.is_grad_enabled():
            # tessera compiles inference graphs: refuse now a call whose result needs gradients,
            # and trace (or start warm) under no_grad a call whose result would not.
            self._refuse_if_grad_needed(_grad_tensors((self.model, args, kwargs)))
            with torch.no_grad():
                return self._compile(args, kwargs)
        if mode == "stock":
            mark_dynamic(values, choice)
            compiled = torch.compile(self.model, backend=stock_backend(self.compile_config.backend))
            return compiled(*args, **kwargs), compiled
        compiler = make_compiler(self.compile_config.backend)
        root = None if self.compile_config.disable_cache else cache_root(self.compile_config.cache_dir)
        remote = remote_tier(self.compile_config.cache_remote) if root is not None else None
        prefix = self.prefix or "model"
        print_ = None
        known_path: model_artifact.OtherPath | None = None
        if root is not None:
            start = time.perf_counter()
            with between_compiles():  # another model's compile must not lend us its config patches
                print_ = fingerprint_record(
                    self._func,
                    self._bound_to,
                    values,
                    choice.dims,
                    self.compile_config,
                    warm_hash(compiler),
                    prefix,
                    rank_dir(),
                ).digest
            self.startup_phases["fingerprint"] = time.perf_counter() - start
            if remote is not None:
                fetch_pointer(remote, root, print_)
            try:
                backend, call, spec = PiecewiseBackend.from_artifact(
                    self.compile_config, compiler, root, prefix, print_, self._traced_fn
                )
                try:
                    args, kwargs = self._fits(spec, args, kwargs)
                except WarmStartUnavailable:
                    counters.bump("warm_start_fallbacks")  # an artifact there, not for this call
                    raise
            except model_artifact.OtherPath as e:
                known_path = e  # graph breaks or sizes the code fixes: no one-graph trace to try
                self.warm_start_refused = str(e)
            except WarmStartUnavailable as e:
                self.warm_start_refused = str(e)
                log.info("%s: no start from the whole-model artifact (%s); tracing once", self.name, e)
            else:
                self._move(backend=backend)
                self.warm_start = True
                self.startup_phases.update(backend.phases)
                start = time.perf_counter()
                fast = functools.partial(call, self._target)
                self._install(fast, spec, _compat.guard_globals(self._traced_fn.__globals__))
                # The forward itself: the root hooks already wrap this first call (_first_call),
                # and _fits has checked and normalised its arguments.
                versions = _versions(args, kwargs)
                output = fast(*args, **kwargs)
                self._mutated = _changed(versions, args, kwargs)
                self.startup_phases["first_call"] = time.perf_counter() - start
                return output, self._life.call
        degenerate = [(n, d) for n, d in choice.dims if values[n].shape[d] < 2]
        if degenerate and self.compile_config.dynamic_shapes != "unbacked":
            # Dynamo specializes sizes 0 and 1 even on marked dims, and models branch on them
            # (transformers: `q_length > 1`), so a trace at size 1 is a trace for size 1 only.
            # This call is served by a trace for its small size (as Dynamo would recompile); the
            # general trace waits for the first call with sizes >= 2.
            if not self._small_before_general:
                log.info(
                    "%s: first call has dynamic size < 2 at %s; served by a trace for that size, "
                    "the general trace waits for sizes >= 2",
                    self.name,
                    degenerate,
                )
            self._small_before_general += 1
            return self._small_call(args, kwargs, choice.dims), None
        self._context = TraceContext(compiler, root, prefix, print_, remote)
        if known_path is not None:
            log.info("%s: %s (recorded by an earlier process)", self.name, known_path)
            if known_path.path == "guarded":
                return self._start_guarded(args, kwargs, values, choice, known_path.reason)
            return self._start_per_size(args, kwargs, known_path.reason)
        try:
            return self._trace(args, kwargs, values, choice), self._life.call
        except SizeFixedError as e:
            self._record_path("per_size", str(e))
            return self._start_per_size(args, kwargs, str(e))
        except UnsupportedModelError as e:
            if self.compile_config.fullgraph or e.dynamo_error is None:
                raise
            self._record_path("guarded", str(e))
            return self._start_guarded(args, kwargs, values, choice, str(e))

    def _record_path(self, path: str, reason: str) -> None:
        """Tell the next process which path this model takes (no one-graph trace to fail again)."""
        root, print_ = self._context.root, self._context.fingerprint
        if root is None or print_ is None:
            return
        try:
            model_artifact.write_path(root, print_, path, reason)
        except OSError as e:  # a read-only cache: the next process fails the one-graph trace too
            log.debug("%s: path not recorded (%s)", self.name, e)

    def _choose(self, values: dict[str, Any]) -> DynamicChoice:
        wanted = self._dynamic_dims
        if self._soft_dims and wanted is not None:
            # Suggested dims (tessera.hf): an argument that is not a tensor in this call (a
            # mask passed as a dict of masks) has none.
            wanted = {n: d for n, d in wanted.items() if isinstance(values.get(n), torch.Tensor)}
        choice = choose_dynamic_dims(self._func, values, wanted)
        dims = tuple(d for d in choice.dims if d not in self._static_dims)
        return DynamicChoice(dims, choice.guessed or self._soft_dims)

    def _small_child(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any] | None:
        """The compiled forward of the small-size child whose check this call passes, if any."""
        for child in tuple(self._small.values()):
            fast = child._life.fast
            if child._accepts is not None and fast is not None and child._accepts(args, kwargs):
                return fast
        return None

    def _small_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], dims: Any, every_size: bool = False
    ) -> Any:
        """A call with a dynamic size under Dynamo's floor of 2: served by a model traced with
        those dims static at this call's sizes (one per distinct combination, compiled once, and
        cached as any model), since code may behave differently there (``x.squeeze()``).
        ``every_size``: the code fixes the dims' sizes, so every size is served this way."""
        values = bind_arguments(self._func, self._bound_to, args, kwargs)
        small = frozenset(
            (name, dim, int(values[name].shape[dim]))
            for name, dim in dims
            if isinstance(values.get(name), torch.Tensor) and (every_size or values[name].shape[dim] < 2)
        )
        with self._lock:
            child = self._small.get(small)
            if child is None:
                label = "-".join(f"{name}{dim}x{size}" for name, dim, size in sorted(small))
                log.info("%s: compiling for the size(s) %s alone", self.name, label)
                prefix = f"{self.prefix or 'model'}-{'size' if every_size else 'small'}-{label}"
                # The forward itself (a wrapper may stand in model.forward by now).
                child = CompiledModel(self._target, self.compile_config, self._dynamic_dims, prefix, None)
                child._static_dims = self._static_dims | {(name, dim) for name, dim, _ in small}
                child._soft_dims, child._mark_nested = self._soft_dims, self._mark_nested
                child._name = f"{self.name} (size {label})"
                self._small[small] = child
        return child(*args, **kwargs)

    def _start_guarded(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        values: dict[str, Any],
        choice: DynamicChoice,
        reason: str,
    ) -> tuple[Any, Callable[..., Any]]:
        """Dynamo cannot trace the model as one graph (a graph break): run it as torch.compile
        would, with Dynamo's guards and re-compiles, each graph split, compiled per size and
        cached by tessera (dynamo_backend.py). Said once, naming every break and its line."""
        from tessera.dynamo_backend import GraphCompiler

        def on_graph(record: GraphReport, backend: PiecewiseBackend) -> None:
            self._graphs.append((record, backend))

        compiler = GraphCompiler(self.compile_config, self.prefix or "model", on_graph)
        # A frame of our own: Dynamo's cache and guards for it are this model's alone.
        compiled = torch.compile(entry_frame(), backend=compiler, dynamic=None)
        target, module = self._target, self._module

        def run(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():  # as the one-graph path: refused, or run as inference
                self._refuse_if_grad_needed(_grad_tensors((args, kwargs)))
                with torch.no_grad():
                    return compiled(target, *args, **kwargs)
            return compiled(target, *args, **kwargs)

        def call(*args: Any, **kwargs: Any) -> Any:
            if module is not None and hooks.active(module):
                return hooks.call_with_hooks(module, run, args, kwargs)
            return run(*args, **kwargs)

        marked = [v for v in values.values() if isinstance(v, torch.Tensor)]
        start = time.perf_counter()
        with _compat.dim_marks_restored(marked):
            mark_dynamic(values, DynamicChoice(choice.dims, True))  # "maybe": Dynamo may keep one static
            output = run(*args, **kwargs)
        self.startup_phases["trace_and_compile"] = time.perf_counter() - start
        breaks = [f"{r.source}: {r.reason}" for r, _ in self._graphs if r.graph_break]
        warnings.warn(
            f"{self.name} has graph breaks, so tessera runs it as torch.compile would: "
            f"{len(self._graphs)} graph(s), each compiled and cached by tessera, Dynamo's guards kept. "
            f"Breaks: {'; '.join(breaks) or reason}. Remove them for one graph "
            "without guards, or pass fullgraph=True to refuse such models",
            TesseraWarning,
            stacklevel=4,
        )
        return output, call

    def _start_per_size(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str
    ) -> tuple[Any, Callable[..., Any]]:
        """The code fixes the size of a dim marked dynamic (``x.view(1, 16, ...)``, a Python loop
        over the sequence), so the trace failed: every size is served by a trace of its own."""
        self._move(backend=None)
        module = self._module

        def call(*args: Any, **kwargs: Any) -> Any:
            if module is not None and hooks.active(module):
                return hooks.call_with_hooks(module, self._per_size_call, args, kwargs)
            return self._per_size_call(*args, **kwargs)

        return self._per_size_call(*args, _reason=reason, **kwargs), call

    def _dims_label(self) -> str:
        return ", ".join(f"{name} dim {dim}" for name, dim in self.marked_dims) or "the arguments"

    def _per_size_call(self, *args: Any, _reason: str = "", **kwargs: Any) -> Any:
        """A call of a model whose code fixes a dynamic dim's size: one graph cannot serve every
        size, so each size gets a trace of its own, as torch.compile recompiles per size, up to
        MAX_SIZE_TRACES sizes; further sizes run eagerly. Both said once, as warnings: the user
        asked for one graph and gets several, or none."""
        child = self._small_child(args, kwargs)
        if child is not None:
            return child(*args, **kwargs)
        if not self._per_size:
            self._per_size = True
            warnings.warn(
                f"{_reason or self.name + ': the code fixes the size of a dim marked dynamic'}; tessera "
                f"traces each size of {self._dims_label()} on its own (as torch.compile recompiles), "
                f"up to {MAX_SIZE_TRACES} sizes, then runs further sizes eagerly",
                TesseraWarning,
                stacklevel=4,
            )
        if len(self._small) >= MAX_SIZE_TRACES:
            if not self.eager_calls:
                warnings.warn(
                    f"{self.name}: {len(self._small)} sizes of {self._dims_label()} traced, the limit; "
                    "further sizes run eagerly. Pad the inputs to a few sizes to serve them compiled",
                    TesseraWarning,
                    stacklevel=4,
                )
            self.eager_calls += 1
            return self._target(*args, **kwargs)
        return self._small_call(args, kwargs, self.marked_dims, every_size=True)

    def _only_fixed_sizes(self, mismatches: list[tuple[call_check.Assumption, Any]]) -> bool:
        """Whether the call differs from the trace only in the size of dims marked dynamic that
        the trace kept static: the code fixed them (a guessed dim is only "maybe dynamic")."""
        return all(self._differs_in_marked_dims(a, found) for a, found in mismatches)

    def _differs_in_marked_dims(self, assumption: call_check.Assumption, found: Any) -> bool:
        match = re.fullmatch(r"(\w+\[[^\]]+\])\.shape(?:\[(\d+)\])?", assumption.expr)
        dims = self._marked_paths.get(match.group(1), frozenset()) if match else frozenset()
        if match is None or not dims:
            return False
        if match.group(2) is not None:  # one static dim of a tensor with dynamic ones
            return int(match.group(2)) in dims
        expected = assumption.expected
        if not isinstance(found, torch.Size) or len(found) != len(expected):
            return False
        return all(f == e or d in dims for d, (f, e) in enumerate(zip(found, expected, strict=True)))

    def _trace(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], values: dict[str, Any], choice: DynamicChoice
    ) -> Any:
        """The one Dynamo trace (or, when argument state changed, one more): install and save it."""
        context = self._context
        compiler, root, prefix, print_, remote = (
            context.compiler,
            context.root,
            context.prefix,
            context.fingerprint,
            context.remote,
        )
        # A trace for small sizes alone (a size-1 decode) is its whole workload: compiled at once.
        receiver = GraphReceiver(
            self.compile_config, compiler, root, prefix, remote, serve_traced=self._name is None
        )
        start = time.perf_counter()
        versions = _versions(args, kwargs)
        marked = [v for v in values.values() if isinstance(v, torch.Tensor)]
        with COMPILE_LOCK, _compat.dim_marks_restored(marked):
            mark_dynamic(values, choice, self.compile_config.dynamic_shapes)
            if self._mark_nested is not None:
                self._mark_nested(values)
            trace = trace_once(
                self._traced_fn,
                receiver,
                self._target,
                args,
                kwargs,
                self._func.__qualname__,
                self._recorder(args, kwargs, choice),
                self._dynamic_state,
                size_oblivious=self.compile_config.dynamic_shapes == "backed_size_oblivious",
            )
        self._mutated = _changed(versions, args, kwargs)
        backend = receiver.received()
        inside = backend.phases.get("split", 0.0) + backend.phases.get("compile", 0.0)
        self.startup_phases["trace"] = (
            self.startup_phases.get("trace", 0.0) + time.perf_counter() - start - inside
        )
        spec: call_check.CallSpec = trace.guards
        self._move(backend=backend)
        self.warm_start, self._trace_code = False, trace.code
        if backend.dumps is not None:
            backend.dumps.transformed_code(trace.code)
        self._install(
            functools.partial(trace.call, self._target),
            spec,
            _compat.guard_globals(self._traced_fn.__globals__),
        )
        if print_ is None:
            backend.start_background()
            return trace.output
        traced_fn, code = self._traced_fn, trace.code

        def save() -> None:  # once every size is compiled (in the background, or now)
            backend.save_artifact(print_, traced_fn, code, spec)
            if remote is not None and root is not None and backend.entry is not None:
                publish(remote, root, print_, backend.entry)
            if self.first_call_seconds is not None and self.cache_dir is not None:
                report = self._make_report()  # the record with every size, for `tessera report`
                save_report(self.cache_dir, report.kind, json.dumps(report.as_dict(), indent=1))

        if not backend.ready.is_set():
            backend.artifact_status = "to be written once every size is compiled"
        backend.start_background(save)
        return trace.output

    # -- the call check ------------------------------------------------------------------------
    def _recorder(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], choice: DynamicChoice
    ) -> Callable[[list[_compat.GuardFact], dict[str, tuple[str | None, ...]], bool], call_check.CallSpec]:
        """What reads Dynamo's guards into the call spec: called during the trace, after the graph
        is compiled and before the first call runs (so a model that appends to a list argument
        is checked against the list as passed)."""
        names = call_check.argument_names(self.signature, args, kwargs)
        dynamic: dict[str, set[int]] = {}
        for name, dim in choice.dims:
            dynamic.setdefault(name, set()).add(dim)
        self._marked_paths = {
            path: frozenset(dynamic[name]) for path, name in names.items() if name in dynamic
        }
        state = _compat.call_state()

        def read(
            facts: list[_compat.GuardFact], symbols: dict[str, tuple[str | None, ...]], writes: bool
        ) -> call_check.CallSpec:
            symbolic = {name: tuple(s is not None for s in dims) for name, dims in symbols.items()}
            translation = dynamo_guards.translate(
                facts, symbolic, lambda n: dynamo_guards.readable(n, names), symbols
            )
            spec = call_check.record(
                args,
                kwargs,
                lambda path: names.get(path, path),
                # Marked dims, and every dim the trace made symbolic (a tensor nested in a dict
                # argument, a mask per attention type): Dynamo's guards bound those, not a size.
                lambda path: (
                    frozenset(dynamic.get(names.get(path, ""), ()))
                    | frozenset(d for d, s in enumerate(symbols.get(path, ())) if s is not None)
                ),
                translation.assumptions,
                translation.parents,
                state,
                writes,
            )
            # An assumption the very call it came from breaks is a translation tessera cannot
            # check: say so (it would refuse every call), and keep the rest.
            bound = spec.bind(self._target, _compat.guard_globals(self._traced_fn.__globals__))
            broken = {a.expr for a, _ in spec.mismatches(args, kwargs, bound)}
            if broken:
                log.warning("%s: guards tessera cannot re-check, not checked: %s", self.name, sorted(broken))
                kept = tuple(a for a in spec.assumptions if a.expr not in broken)
                spec = dataclasses.replace(spec, assumptions=kept)
            self.dropped_guards = translation.dropped
            return spec

        return read

    def _fits(
        self, spec: call_check.CallSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The first call in the saved artifact's structure, or WarmStartUnavailable if it differs."""
        try:
            args, kwargs = call_check.normalise(self.signature, spec, args, kwargs)
        except call_check.InputMismatchError as e:
            raise WarmStartUnavailable(f"this call differs from the traced one: {e}") from e
        if spec.global_state and spec.global_state != _compat.call_state():
            state = call_check.explain_state(spec.global_state, _compat.call_state())
            raise WarmStartUnavailable(f"the artifact was traced under another state: {state}")
        try:
            bound = spec.bind(self._target, _compat.guard_globals(self._traced_fn.__globals__))
        except call_check.InputMismatchError as e:
            raise WarmStartUnavailable(str(e)) from e
        mismatches = spec.mismatches(args, kwargs, bound)
        if mismatches:
            raise WarmStartUnavailable(
                f"this call differs from the traced one: {call_check.explain(mismatches)}"
            )
        return args, kwargs

    def _install(
        self, fast: Callable[..., Any], spec: call_check.CallSpec, globals_: dict[str, Any]
    ) -> Callable[..., Any]:
        """Every later call: root hooks as in eager, the call check, then the compiled forward."""
        self._bound = spec.bind(self._target, globals_)
        self._tensors = call_check.tensor_reader(spec, self._bound)
        call = (
            call_check.make_checked_call(spec, fast, self._slow_call, self._bound)
            if self.compile_config.check_inputs
            else fast
        )
        checked = call
        self._accepts = (
            call_check.make_predicate(spec, self._bound) if self.compile_config.check_inputs else None
        )
        module = self._module
        if module is not None:

            def call(*args: Any, **kwargs: Any) -> Any:
                if hooks.active(module):
                    return hooks.call_with_hooks(module, checked, args, kwargs)
                return checked(*args, **kwargs)

        self._move(call=call, checked=checked, fast=fast, spec=spec)
        return call

    def _refuse_if_grad_needed(self, tensors: Any) -> None:
        """Raise GradientsNotSupportedError when a tensor the call reads requires grad (grad is on)."""
        needing = next((t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if needing is not None:
            owner = self._module if self._module is not None else self._bound_to
            names = (
                {id(p): n for n, p in owner.named_parameters()} if isinstance(owner, torch.nn.Module) else {}
            )
            what = (
                f"parameter {names[id(needing)]}"
                if id(needing) in names
                else call_check.describe_tensor(needing)
            )
            raise call_check.GradientsNotSupportedError(
                f"{self.name}: called with grad enabled and {what} requires grad, so eager's result "
                "would carry gradients. tessera "
                "compiles inference graphs: call it under torch.inference_mode() or torch.no_grad(), "
                "freeze the parameters (model.requires_grad_(False)), or use mode='stock' to train"
            )

    def _slow_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call that failed the quick check: under another state, with grad enabled, in another
        structure or layout, or refused."""
        child = self._small_child(args, kwargs)
        if child is not None:
            return child(*args, **kwargs)
        life = self._life
        spec, checked, fast = life.spec, life.checked, life.fast
        assert spec is not None and checked is not None and fast is not None, "runs after a trace"
        state = _compat.call_state()
        if spec.global_state and state != spec.global_state:
            raise call_check.StateMismatchError(
                f"{self.name}: {call_check.explain_state(spec.global_state, state)}. "
                "tessera traced the model once, under the first call's state, and that state is baked "
                "into its graph: call it under the same state, or compile another instance for this one"
            )
        if torch.is_grad_enabled():
            self._refuse_if_grad_needed(self._tensors(args, kwargs))
            self._refuse_if_grad_needed(_grad_tensors((args, kwargs)))
            with torch.no_grad():  # nothing needs grad: the inference graph gives eager's result
                return checked(*args, **kwargs)
        args, kwargs = call_check.normalise(self.signature, spec, args, kwargs)
        mismatches = spec.mismatches(args, kwargs, self._bound)
        if mismatches:
            args, kwargs = self._fix_layouts(args, kwargs, mismatches)
            mismatches = spec.mismatches(args, kwargs, self._bound)
        if not mismatches:
            return fast(*args, **kwargs)
        if all(a.floor for a, _ in mismatches):
            return self._small_call(args, kwargs, self.marked_dims)
        if self._only_fixed_sizes(mismatches):
            return self._per_size_call(*args, **kwargs)
        changed = [
            a.expr
            for a, found in mismatches
            if a.state and validation.is_int(a.expected) and validation.is_int(found)
        ]
        retrace = self._state_retraces < MAX_STATE_RETRACES and _compat.supports_dynamic_state()
        if retrace and len(changed) == len(mismatches):
            return self._retrace_for_state(args, kwargs, changed)
        raise call_check.InputMismatchError(f"{self.name}: {call_check.explain(mismatches)}")

    def _fix_layouts(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        mismatches: list[tuple[call_check.Assumption, Any]],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Arguments whose only difference is their layout, copied into the traced layout (the
        compiled code assumes it). An argument the model writes to is not copied: the write would
        miss the caller's tensor, so the check refuses it."""
        positional, keywords = list(args), dict(kwargs)
        for assumption, _ in mismatches:
            path = call_check.layout_path(assumption)
            if path is None or path in self._mutated or (self.call_spec and self.call_spec.writes_in_place):
                continue
            kind, key = path
            if kind == "args" and isinstance(positional[int(key)], torch.Tensor):
                positional[int(key)] = call_check.to_layout(positional[int(key)], assumption.expected)
            elif kind == "kwargs" and isinstance(keywords.get(key), torch.Tensor):
                keywords[key] = call_check.to_layout(keywords[key], assumption.expected)
        return tuple(positional), keywords

    def _retrace_for_state(self, args: tuple[Any, ...], kwargs: dict[str, Any], changed: list[str]) -> Any:
        """A Python int the trace read from an argument object changed (a StaticCache's length):
        trace once more with it as a symbol, as Dynamo's automatic dynamic shapes would."""
        with self._lock:
            self._state_retraces += 1
            self._dynamic_state = tuple(dict.fromkeys((*self._dynamic_state, *changed)))
            log.info(
                "%s: %s changed since the first call; tracing once more with %d argument int(s) symbolic",
                self.name,
                changed[0],
                len(self._dynamic_state),
            )
            values = bind_arguments(self._func, self._bound_to, args, kwargs)
            self._move(stage=Stage.RETRACING)
            try:
                output = self._trace(args, kwargs, values, self._choose(values))
            finally:
                self._move(stage=Stage.READY)  # the earlier trace's path still serves if this failed
            self._counters = counter_delta(self._counters_before, counters.snapshot())
            return output


def _grad_tensors(obj: Any, depth: int = 0) -> Any:
    """Every tensor ``obj`` holds that could carry gradients: tensors in containers, a module's
    parameters and buffers, a function's closure (bounded depth: this runs with grad enabled)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
    elif depth > 4:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _grad_tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _grad_tensors(item, depth + 1)
    elif isinstance(obj, types.MethodType):
        yield from _grad_tensors(obj.__self__, depth + 1)
        yield from _grad_tensors(obj.__func__, depth + 1)
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from _grad_tensors(contents, depth + 1)


def _top_level_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            yield ("args", str(i)), value
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            yield ("kwargs", key), value


def _versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[tuple[str, str], int]:
    """The version counter of each top-level tensor argument (in-place writes bump it)."""
    out = {}
    for path, tensor in _top_level_tensors(args, kwargs):
        try:
            out[path] = tensor._version
        except RuntimeError:  # an inference tensor has no version counter (nor can it be written)
            continue
    return out


def _changed(
    before: dict[tuple[str, str], int], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> frozenset[tuple[str, str]]:
    """The arguments whose version moved since ``before``: the ones the model writes to."""
    return frozenset(
        path for path, tensor in _top_level_tensors(args, kwargs) if before.get(path, -1) != _version(tensor)
    )


def _version(tensor: torch.Tensor) -> int:
    try:
        return int(tensor._version)
    except RuntimeError:
        return -1
