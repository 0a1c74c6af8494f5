"""Every private PyTorch API tessera touches, in one place, with the versions it was checked on.

Nothing here is imported eagerly: Dynamo and Inductor cost ~1 s to import, and a warm start from
the whole-model artifact needs neither. Each helper says which torch versions it was checked on
(2.11 and 2.13 unless noted) and what public API would let it go.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import re
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.modules import module as nn_module  # loaded by `import torch`; read on every call

log = logging.getLogger(__name__)

# Dynamo installs the compiled graph as a global of the traced function's module under a name
# with this prefix (torch 2.11-2.13, convert_frame / output_graph). No public name exists.
COMPILED_FN_PREFIX = "__compiled_fn"


# The torch releases this module was checked on (tests/test_compat.py, docs/versions.md).
TESTED_TORCH = ((2, 11), (2, 15))


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch), ``2.15.0+cpu`` -> (2, 15)."""
    match = re.match(r"^(\d+)\.(\d+)", version or torch.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def untested_torch(version: str | None = None) -> str | None:
    """Why the installed torch is outside the tested range (None when inside it)."""
    release = torch_release(version)
    low, high = TESTED_TORCH
    if low <= release <= high:
        return None
    return (
        f"torch {version or torch.__version__} is outside the range tessera is tested on "
        f"({low[0]}.{low[1]} to {high[0]}.{high[1]}): tessera runs, and its call check and cache "
        "refuse what they cannot read, but report anything odd with your torch version"
    )


# -- Dynamo -------------------------------------------------------------------------------------
def dynamo() -> types.ModuleType:
    """``torch._dynamo``, imported on first use (~0.6 s): only the tracing path needs it."""
    import torch._dynamo

    return torch._dynamo


# Used when Dynamo has no compile lock of its own (none of 2.11-2.15): compiles still serialise.
_FALLBACK_COMPILE_LOCK = threading.RLock()


@functools.cache
def dynamo_compile_lock() -> Any:
    """Dynamo's process-wide compile lock (an RLock), held while it converts a frame and runs the
    backend: ``torch._dynamo.convert_frame.compile_lock`` (torch 2.11-2.15; Inductor's backward
    compile takes it too). No public API; tessera's compiles take it so that no two compiles of a
    process overlap (see compile_state.COMPILE_LOCK). Imports Dynamo: call it on compile paths only.
    """
    from torch._dynamo import convert_frame

    return getattr(convert_frame, "compile_lock", _FALLBACK_COMPILE_LOCK)


_FX_TRACING_HERE = threading.local()  # per thread: how deep in torch.fx's Tracer.trace it is


def _tracing_in_this_thread() -> bool:
    return getattr(_FX_TRACING_HERE, "depth", 0) > 0


@functools.cache
def isolate_fx_tracing_flag() -> None:
    """Make torch.fx's "an FX trace is running" flag answer for the calling thread only.

    Reason: on torch 2.11-2.13 ``torch.fx._symbolic_trace._is_fx_tracing_flag`` is one process-wide
    bool set by ``Tracer.trace``, which every compile runs (AOTAutograd's make_fx). While a
    background compile traces, a call in another thread of any ``torch.compile``'d function reads
    it and raises "Detected that you are using FX to symbolically trace a dynamo-optimized
    function" (pytorch/pytorch#126024). torch 2.14 made the flag thread-local
    (pytorch/pytorch#168999); there this does nothing. On older torch, ``Tracer.trace`` counts its
    depth per thread, and the flag's two readers (``is_fx_tracing``, ``is_fx_symbolic_tracing``)
    are given code that also asks that count. Their code objects are replaced, not the functions:
    Dynamo keys tables on these function objects, and ``torch.compile`` wrappers made before
    this ran hold them. Remove when 2.13 leaves the supported range.
    """
    module = sys.modules.get("torch.fx._symbolic_trace")
    if module is None or not hasattr(module, "_is_fx_tracing_flag") or hasattr(module, "_is_fx_tracing_tls"):
        return
    tracer = module.Tracer
    original = tracer.trace
    if getattr(original, "_tessera_counts_depth", False):
        return

    @functools.wraps(original)
    def trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_FX_TRACING_HERE, "depth", 0)
        _FX_TRACING_HERE.depth = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _FX_TRACING_HERE.depth = depth

    trace._tessera_counts_depth = True  # type: ignore[attr-defined]
    tracer.trace = trace
    # The readers' new code runs in torch.fx._symbolic_trace's globals: the one name it adds there.
    module.__dict__["_tessera_tracing_in_this_thread"] = _tracing_in_this_thread

    def is_fx_tracing() -> bool:
        is_fx_tracing_warning()  # type: ignore[name-defined]  # noqa: F821  (a name of that module)
        return bool(
            _is_fx_tracing_flag  # type: ignore[name-defined]  # noqa: F821
            and _tessera_tracing_in_this_thread()  # type: ignore[name-defined]  # noqa: F821
        )

    def is_fx_symbolic_tracing() -> bool:
        return bool(
            _is_fx_tracing_flag  # type: ignore[name-defined]  # noqa: F821
            and _tessera_tracing_in_this_thread()  # type: ignore[name-defined]  # noqa: F821
            and not torch.compiler.is_compiling()
        )

    module.is_fx_tracing.__code__ = is_fx_tracing.__code__
    module.is_fx_symbolic_tracing.__code__ = is_fx_symbolic_tracing.__code__


@functools.cache
def isolate_fx_patches() -> None:
    """Make the methods torch.fx patches on classes while it traces act in the tracing thread only.

    Reason: for the length of a trace, ``Tracer.trace`` replaces ``torch.nn.Module.__call__`` and
    ``__getattr__`` on the class, process-wide, through ``_Patcher.patch_method`` (read on torch
    2.13 only; ``_Patcher`` dates from pytorch/pytorch#50793, 2021: without it this does nothing).
    Every compile traces: AOTAutograd's make_fx, and Inductor's ``symbolic_trace`` of a one-line
    function (``loop_body.InterpreterShim._dummy_gm``, once per process, in the first compile that
    analyses a loop's index bounds: a static size). A module called meanwhile in another thread
    (the user's eager model, a piece served as traced while it compiles in the background) entered
    that trace: the plain ``Tracer`` looks it up under its own root and raises ``NameError: module
    is not installed as a submodule``; make_fx's tracer runs it through its own bookkeeping. Here
    each method patched on a class is installed behind a function that calls the tracer's wrapper
    in the thread that patched and, in any other thread, what the class had before. The tracing
    thread sees no change, nested traces and Dynamo's revert and reapply of the patches included
    (``_maybe_revert_all_patches`` reads the process-wide ``CURRENT_PATCHER``: safe because every
    compile, Dynamo's and tessera's, holds Dynamo's compile lock). Patches of module globals
    (``torch.fx.wrap``, autowrapped ``math`` functions) stay as they are: their wrappers act on a
    ``Proxy`` argument only, which another thread never has. Two FX traces in two threads at once
    stay unsupported (torch undoes patches in its own order). pytorch/pytorch#187589 proposes the
    same upstream (a thread-local patcher); remove once every supported torch has it.
    """
    import torch.fx._symbolic_trace as module  # loaded by ``import torch``

    patcher = getattr(module, "_Patcher", None)
    original = getattr(patcher, "patch_method", None)
    if original is None or getattr(original, "_tessera_this_thread_only", False):
        return

    @functools.wraps(original)
    def patch_method(
        self: Any, cls: type, name: str, new_fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        return original(self, cls, name, _in_this_thread_only(new_fn, getattr(cls, name)), *args, **kwargs)

    patch_method._tessera_this_thread_only = True  # type: ignore[attr-defined]
    patcher.patch_method = patch_method  # type: ignore[union-attr]


def _in_this_thread_only(patched: Callable[..., Any], previous: Callable[..., Any]) -> Callable[..., Any]:
    """``patched`` when called from the calling thread, ``previous`` from any other."""
    owner = threading.get_ident()

    @functools.wraps(patched)
    def this_thread_only(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == owner:
            return patched(*args, **kwargs)
        return previous(*args, **kwargs)

    return this_thread_only


def isolate_fx_tracing() -> None:
    """What one thread's FX trace changes process-wide, seen by that thread only: the tracing flag
    (``isolate_fx_tracing_flag``) and the patched ``nn.Module`` methods (``isolate_fx_patches``).
    Called under ``compile_state.COMPILE_LOCK`` (every compile of tessera's) and before a compile
    thread starts: one cache lookup after the first call."""
    isolate_fx_tracing_flag()
    isolate_fx_patches()


def register_bytecode_hook(hook: Callable[[types.CodeType, types.CodeType], None]) -> Any:
    """Call ``hook(original, transformed)`` for every frame Dynamo converts; returns a handle.

    torch 2.11-2.13: ``torch._dynamo.convert_frame.register_bytecode_hook`` (no public API yet).
    """
    from torch._dynamo.convert_frame import register_bytecode_hook as register

    return register(hook)  # type: ignore[arg-type]


def reset_code(code: types.CodeType) -> None:
    """Drop Dynamo's compiled entries for one code object (torch 2.11-2.13: ``_dynamo.reset_code``)."""
    dynamo().reset_code(code)


@contextlib.contextmanager
def single_trace_settings(
    dynamic_state: tuple[str, ...] = (), size_oblivious: bool = False
) -> Iterator[None]:
    """Dynamo settings for the one guard-free trace tessera makes of a function.

    A full recompile cache of earlier entries of this code must never refuse our trace
    (``recompile_limit`` names, torch 2.11-2.13). ``dynamic_state``: Python ints read from the
    arguments (``kwargs['cache'].length``, source names relative to the frame) traced as symbols
    through ``torch.compiler.config.dynamic_sources`` (torch >= 2.11; exact names, so escaped).
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(dynamo().config.patch(recompile_limit=64, accumulated_recompile_limit=4096))
        # torch 2.11 takes nn.TransformerEncoderLayer's fused eval fast path while Dynamo traces,
        # and that kernel has no fake implementation (2.13 skips it when compiling). The traced
        # graph needs the plain path only; the public switch is restored after the trace.
        fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        stack.callback(torch.backends.mha.set_fastpath_enabled, fastpath)
        if size_oblivious:
            # Backed sizes reasoned about as if >= 2 (torch.fx.experimental._config, 2.11-2.13).
            from torch.fx.experimental import _config as fx_config

            stack.enter_context(fx_config.patch(backed_size_oblivious=True))  # type: ignore[attr-defined]
        if dynamic_state:
            names = ",".join(re.escape(dynamo_source_name(expr)) for expr in dynamic_state)
            stack.enter_context(torch.compiler.config.patch(dynamic_sources=names))  # type: ignore[attr-defined]
        yield


def size_oblivious_enabled() -> bool:
    """Whether backed sizes are reasoned about size-obliviously now (torch.fx.experimental._config,
    torch 2.11-2.15): set while tessera traces, and needed again by every compile of that trace."""
    from torch.fx.experimental import _config as fx_config

    return bool(getattr(fx_config, "backed_size_oblivious", False))


@contextlib.contextmanager
def size_oblivious() -> Iterator[None]:
    """Backed sizes reasoned about as if >= 2 while a size-oblivious trace's graph is compiled:
    Inductor's own shape decisions would otherwise read a size-1 hint as the size and specialise
    the general artifact to it (a trace made at size 1 then served size 3 wrongly)."""
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
        yield


@contextlib.contextmanager
def compile_guards_ignored(example_inputs: Sequence[Any]) -> Iterator[None]:
    """While a backend compiles Dynamo's graph: the shape decisions the compiler makes on the
    hints (Inductor's lowering asks ``size != 1`` of a view) record no guard
    (``ShapeEnv.suppress_guards``, torch 2.11-2.15). The call check holds what the trace itself
    decided; a compile made in the background, after the guards were read, never added any, and an
    up-front compile must not add what a background one would not (a size-1 call refused, then
    traced again, for the compiler's hint-based ``s > 1``)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(list(example_inputs))
    shape_env = getattr(mode, "shape_env", None)
    if shape_env is None:
        yield
        return
    with shape_env.suppress_guards():
        yield


def override_size_hint(tensor: torch.Tensor, dim: int, hint: int) -> None:
    """Trace ``tensor``'s dim with ``hint`` as its size hint (what ``mark_dynamic(...,
    hint_override=)`` records, torch 2.11-2.15, read for every mark kind when the tensor is
    fakified): decisions made on the hint (Inductor's code generation) see a general size."""
    overrides = getattr(tensor, "_dynamo_hint_overrides", None)
    if overrides is None:
        overrides = {}
        tensor._dynamo_hint_overrides = overrides  # type: ignore[attr-defined]
    overrides[dim] = hint


def mark_unbacked(tensor: torch.Tensor, dim: int) -> None:
    """``torch._dynamo.decorators.mark_unbacked`` (torch 2.11-2.13)."""
    from torch._dynamo.decorators import mark_unbacked as mark

    mark(tensor, dim)


# What Dynamo's mark_dynamic / maybe_mark_dynamic / mark_unbacked leave on a tensor (torch
# 2.11-2.15, torch/_dynamo/decorators.py): attributes that outlive the call they were set for.
_DIM_MARKS = (
    "_dynamo_dynamic_indices",
    "_dynamo_dynamic_range",
    "_dynamo_weak_dynamic_indices",
    "_dynamo_unbacked_indices",
    "_dynamo_strict_unbacked_indices",
    "_dynamo_unbacked_bounds",
    "_dynamo_hint_overrides",
    "_specialize_on",
    "_has_dynamo_dim_marking",  # 2.13+: guarded on by Dynamo ("present at runtime, absent at compile")
)


@contextlib.contextmanager
def dim_marks_restored(tensors: list[torch.Tensor]) -> Iterator[None]:
    """The tensors' dim marks as they were before the body (torch 2.11-2.15): tessera marks the
    caller's tensors for its one trace, and a mark left behind would follow the tensor into the
    caller's own torch.compile, or into another trace of the same tensor (one per size)."""
    saved = [(t, {n: copy.copy(t.__dict__[n]) for n in _DIM_MARKS if n in t.__dict__}) for t in tensors]
    try:
        yield
    finally:
        for tensor, marks in saved:
            for name in _DIM_MARKS:
                if name in marks:
                    setattr(tensor, name, marks[name])
                elif name in tensor.__dict__:
                    delattr(tensor, name)


def supports_dynamic_state() -> bool:
    return hasattr(torch.compiler.config, "dynamic_sources")


def dynamo_source_name(expr: str) -> str:
    """``kwargs['x'].n`` (a guard's name) as Dynamo's full source name ``L['kwargs']['x'].n``."""
    root, rest = re.match(r"^(\w+)(.*)$", expr).groups()  # type: ignore[union-attr]
    return f"L[{root!r}]{rest}"


def guard_code(guard: Any) -> list[str]:
    """The Python expressions of a guard entry (``orig_guard.code_list``, torch 2.11-2.13)."""
    code = getattr(getattr(guard, "orig_guard", None), "code_list", None)
    return [c for c in code or () if isinstance(c, str)]


@dataclasses.dataclass(frozen=True)
class GuardFact:
    """One guard Dynamo produced, as tessera reads it (``GuardFilterEntry``, torch 2.11-2.15)."""

    kind: str  # Dynamo's guard type: "TENSOR_MATCH", "CONSTANT_MATCH", ...
    name: str  # its source, relative to the frame: ``args[0]``, ``kwargs['cache'].layers[0].keys``
    value: Any  # the guarded object, read before the first call ran (None when not has_value)
    has_value: bool
    is_global: bool
    code: tuple[str, ...]  # Dynamo's Python form of the guard, where it has one
    detail: tuple[tuple[str, str], ...] = ()  # string arguments of the guard (HASATTR's ``attr``)


def guard_fact(entry: Any) -> GuardFact:
    """A ``GuardFilterEntry`` (the argument of ``guard_filter_fn``) as a ``GuardFact``."""
    has_value = bool(getattr(entry, "has_value", False))
    return GuardFact(
        kind=str(entry.guard_type),
        name=str(getattr(entry, "name", "") or ""),
        value=entry.value if has_value else None,
        has_value=has_value,
        is_global=bool(getattr(entry, "is_global", False)),
        code=tuple(guard_code(entry)),
        detail=_guard_detail(entry),
    )


def _guard_detail(entry: Any) -> tuple[tuple[str, str], ...]:
    # GuardBuilder methods bound with functools.partial carry their arguments (attr=, key=) in
    # orig_guard.create_fn.keywords (torch 2.11-2.15); the C++ guard has no Python form to read.
    # A Source argument (DUPLICATE_INPUT's ``source_b``) is kept as its name: ``name`` is a method
    # up to torch 2.13 and a property after.
    create = getattr(getattr(entry, "orig_guard", None), "create_fn", None)
    keywords = getattr(create, "keywords", None) or {}
    out = []
    for key, argument in keywords.items():
        value = argument
        if not isinstance(value, str) and hasattr(value, "name") and hasattr(value, "guard_source"):
            value = value.name() if callable(value.name) else value.name
        if isinstance(value, str):
            out.append((key, value))
    return tuple(sorted(out))


def placeholder_values(gm: torch.fx.GraphModule) -> list[Any]:
    """The fake value of each graph input (SymInts and tensors with symbolic sizes), from the
    placeholders' ``example_value`` metadata (torch 2.11-2.15)."""
    return [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]


def placeholder_dims(gm: torch.fx.GraphModule) -> dict[str, tuple[str | None, ...]]:
    """Source name (``args[0]``) -> per dim of that graph input, the symbol Dynamo gave it (its
    expression as text), or None for a static dim.

    Read from the placeholders' ``grapharg`` and ``example_value`` metadata (torch 2.11-2.15; no
    public accessor). A dim Dynamo specialised (a default dim the code fixes) reads as static.
    """
    out: dict[str, tuple[str | None, ...]] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        value = node.meta.get("example_value")
        if source is None or not isinstance(value, torch.Tensor):
            continue
        name = local_source_name(source.name() if callable(source.name) else str(source.name))
        out[name] = tuple(
            str(sym_expr(s)) if isinstance(s, torch.SymInt) and not is_constant_symint(s) else None
            for s in value.shape
        )
    return out


def local_source_name(name: str) -> str:
    """Dynamo's ``L['kwargs']['x']`` as the guard-entry form ``kwargs['x']`` (the inverse of
    ``dynamo_source_name``)."""
    return re.sub(r"\bL\[['\"](\w+)['\"]\]", r"\1", name)


def call_state() -> tuple[Any, ...]:
    """The global state a traced graph bakes in: autocast (per device: enabled, dtype), the default
    dtype, and the depth of the torch-function mode stack (``with torch.device(...)``,
    ``set_default_device``). Grad mode is handled apart (inference graphs, see api.py).

    ``torch.get_autocast_dtype`` and ``torch._C._len_torch_function_stack`` (torch 2.11-2.15).
    """
    autocast = tuple(
        (device, torch.get_autocast_dtype(device))
        for device in AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )
    return (autocast, torch.get_default_dtype(), torch._C._len_torch_function_stack())


# Devices whose autocast state a call check compares (the ones torch 2.11-2.15 CPUs and GPUs use).
AUTOCAST_DEVICES = ("cpu", "cuda")


def any_autocast() -> Callable[[], bool]:
    """A cheap test of whether any autocast is on (``torch._C._is_any_autocast_enabled``, 2.11-2.15)."""
    return torch._C._is_any_autocast_enabled  # type: ignore[no-any-return]


def function_mode_depth() -> Callable[[], int]:
    """``torch._C._len_torch_function_stack`` (torch 2.11-2.15): > 0 under ``with torch.device()``."""
    return torch._C._len_torch_function_stack  # type: ignore[no-any-return]


class _GuardGlobals(dict):  # type: ignore[type-arg]
    """The traced frame's globals as Dynamo's guards name them (``G['__import_torch']``): names
    Dynamo installed in the cold process, resolved on demand in a warm one."""

    def __missing__(self, name: str) -> Any:
        # Dynamo's aliases (torch 2.11-2.15): __import_<module with '.' as '_dot_'>, and
        # __builtins_dict___<n> for the builtins' dict.
        if name.startswith("__import_"):
            value: Any = module_for_bytecode(name[len("__import_") :].replace("_dot_", "."))
        elif name.startswith("__builtins_dict__"):
            import builtins

            value = builtins.__dict__
        else:
            raise KeyError(name)
        self[name] = value
        return value


def guard_globals(namespace: dict[str, Any]) -> dict[str, Any]:
    """What ``G`` means in a guard's expression, for a frame whose globals are ``namespace``."""
    return _GuardGlobals(namespace)


def trace_errors() -> tuple[type[BaseException], ...]:
    """Dynamo's errors for code that cannot be one graph (``Unsupported``, ``UserError``)."""
    exc = dynamo().exc
    return (exc.Unsupported, exc.UserError)


# Dynamo's graph-break kinds (``Unsupported.gb_type``, torch 2.13; the first line of the message
# on 2.11) that say an op or the code raised on the traced values: a TypeError or RuntimeError of
# an op run on fake tensors (``RuntimeError when making fake tensor call``), or an exception the
# code raised and nothing caught (``Observed exception``). Eager would most likely raise too.
_RAISED_ON_VALUES = re.compile(r"^(Observed exception|\w+ when making fake tensor call)")


def raised_on_values(error: BaseException) -> bool:
    """Whether a failed trace failed because an op or the code raised on the call's values (what
    eager may raise as well: ``x @ w`` with the wrong sizes, ``None.view``), not because Dynamo
    cannot trace the code. ``error`` is Dynamo's, or an UnsupportedModelError holding it as
    ``dynamo_error``. ``TorchRuntimeError`` / ``Unsupported`` (torch 2.11-2.13, ``_dynamo.exc``)."""
    error = getattr(error, "dynamo_error", None) or error
    exc = dynamo().exc
    if isinstance(error, exc.TorchRuntimeError):
        return True
    if not isinstance(error, exc.Unsupported):
        return False
    kind = getattr(error, "gb_type", None) or next(iter(str(error).strip().splitlines()), "")
    return bool(_RAISED_ON_VALUES.match(str(kind)))


# What torch logs at WARNING or above while a trace fails, about a failure it then raises (so the
# log line only repeats the error tessera handles: retried another way, or raised to the caller in
# eager's or tessera's words). Checked on torch 2.11-2.13: fake_tensor's ``log.exception`` when a
# meta kernel raises (``x @ w`` with the wrong sizes, or a size-oblivious trace a kernel refuses),
# and the one when an op raises TypeError; symbolic_shapes' warning when a guard fails to evaluate.
_TRACE_FAILURE_LOGS: dict[str, tuple[str, ...]] = {
    "torch._subclasses.fake_tensor": (
        "failed while attempting to run meta for",
        "fake tensor raised TypeError",
    ),
    "torch.fx.experimental.symbolic_shapes": ("failed during evaluate_expr",),
}


class _TraceFailureLogs(logging.Filter):
    """Turns torch's log lines about a failure it raises into DEBUG lines of tessera's logger."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not str(record.msg).startswith(self.starts):
            return True
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "torch (%s), during a trace: %s", record.name, record.getMessage(), exc_info=record.exc_info
            )
        return False


@contextlib.contextmanager
def trace_failure_logs_quiet() -> Iterator[None]:
    """torch's own log lines about an error raised in a trace, at DEBUG (tessera's logger) for the
    body instead of on stderr: the error itself reaches tessera, which retries the trace another way
    or raises it (in eager's words where eager rejects the call). Every other record, and these at
    DEBUG (``TORCH_LOGS``), passes as before. A filter per logger, removed on the way out."""
    added = []
    for name, starts in _TRACE_FAILURE_LOGS.items():
        logger, quiet = logging.getLogger(name), _TraceFailureLogs(starts)
        logger.addFilter(quiet)
        added.append((logger, quiet))
    try:
        yield
    finally:
        for logger, quiet in added:
            logger.removeFilter(quiet)


def backend_failure(error: BaseException) -> BaseException | None:
    """What a backend raised, when ``error`` is Dynamo's ``BackendCompilerFailed`` wrapping it."""
    if type(error).__name__ != "BackendCompilerFailed":
        return None
    return getattr(error, "inner_exception", None) or error.__cause__


def graph_compile_reason(gm: torch.fx.GraphModule) -> tuple[str, str, bool]:
    """Why Dynamo ended the graph it hands a backend: (reason, where in the user's code, whether
    it was a graph break). Where: the innermost frame outside torch, and torch's own frame after
    it when the break is inside torch. Read from ``gm.compile_subgraph_reason`` (a
    ``GraphCompileReason``; torch 2.11-2.15)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None:
        return "", "", False
    stack = list(getattr(reason, "user_stack", None) or ())
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    user = [f for f in stack if not f.filename.startswith(torch_dir)]
    where = ""
    if stack:
        frame = user[-1] if user else stack[-1]
        where = f"{frame.filename}:{frame.lineno} in {frame.name}"
        if frame is not stack[-1]:
            inner = stack[-1]
            where += f" (in torch: {os.path.basename(inner.filename)}:{inner.lineno} {inner.name})"
    text = str(getattr(reason, "reason", "")).strip().splitlines()
    return (text[0] if text else ""), where, bool(getattr(reason, "graph_break", False))


def constraint_violation_error() -> type[BaseException]:
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    return ConstraintViolationError


def traced_code_objects() -> list[types.CodeType] | None:
    """The code objects Dynamo traced for the graph being compiled, or None if unknown.

    ``TracingContext.get_traced_code()`` on torch 2.13; its ``traced_code`` list attribute on
    torch 2.11. Remove the fallback once 2.13 is the oldest supported torch.
    """
    context = torch._guards.TracingContext
    getter = getattr(context, "get_traced_code", None)
    if getter is not None:
        return list(getter() or ())
    current = context.try_get()
    codes = getattr(current, "traced_code", None) if current is not None else None
    return list(codes) if codes else None


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (real or fake) tensors are views of one storage."""
    try:
        return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
        return False


def sym_expr(value: torch.SymInt) -> Any:
    """The sympy expression behind a SymInt (``SymInt.node.expr``, torch 2.11-2.13)."""
    return value.node.expr


def is_constant_symint(value: torch.SymInt) -> bool:
    return not sym_expr(value).free_symbols


def size_hint(value: int | torch.SymInt) -> int:
    """The example value behind a size or stride: a SymInt's hint, an int itself."""
    if isinstance(value, int):
        return value
    try:  # torch 2.13 renamed hint_int to optimization_hint
        from torch.fx.experimental.symbolic_shapes import optimization_hint as hint
    except ImportError:  # torch 2.11-2.12
        from torch.fx.experimental.symbolic_shapes import hint_int as hint  # type: ignore[attr-defined,no-redef]
    return int(hint(value))


def version_counter(tensor: torch.Tensor) -> int:
    """A tensor's version counter, which an in-place write bumps (``Tensor._version``, torch
    2.11-2.15; no public accessor); -1 for an inference tensor, which has none."""
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor has no version counter (nor can it be written)
        return -1


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` views another's storage (``Tensor._is_view``, torch 2.11-2.15; fake
    tensors answer as the real ones would)."""
    return bool(tensor._is_view())


# The classes of ``torch.ops.ns.op`` and ``torch.ops.ns.op.overload`` (torch._ops, 2.11-2.13).
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


def op_schema_name(op: torch._ops.OpOverload) -> str:
    """``ns::op`` of an overload (``OpOverload._schema.name``, torch 2.11-2.13)."""
    return op._schema.name  # type: ignore[no-any-return]


def overload_of(op: torch._ops.OpOverload) -> str:
    """The overload's own name (``default``, ``Tensor``): ``OpOverload._overloadname``."""
    return op._overloadname  # type: ignore[no-any-return]


def op_overload_name(op: torch._ops.OpOverload) -> str:
    return f"{op_schema_name(op)}.{overload_of(op)}"


def op_is_mutable(op: torch._ops.OpOverload) -> bool:
    """Whether the op writes any argument (``OpOverload._schema.is_mutable``, torch 2.11-2.13)."""
    return bool(op._schema.is_mutable)


def packet_name(op: torch._ops.OpOverloadPacket) -> str:
    return op._qualified_op_name  # type: ignore[no-any-return]


# Helpers Dynamo's transformed bytecode calls through ``__import_torch_dot__dynamo_dot_utils``
# (torch 2.11-2.13). Served here so that running saved bytecode never imports Dynamo; any other
# attribute falls through to the real module. Each mirrors torch/_dynamo/utils.py.
def _call_size(x: Any, i: int) -> int:
    return x.size(i)  # type: ignore[no-any-return]


def _call_stride(x: Any, i: int) -> int:
    return x.stride(i)  # type: ignore[no-any-return]


def _call_storage_offset(x: Any) -> int:
    return x.storage_offset()  # type: ignore[no-any-return]


def _record_pregraph_bytecode_enter() -> Any:
    cm: Any = (
        torch._C._profiler._RecordFunctionFast("Pregraph bytecode")
        if torch.autograd.profiler._is_profiler_enabled
        else contextlib.nullcontext()
    )
    cm.__enter__()
    return cm


def _record_pregraph_bytecode_exit(cm: Any) -> None:
    cm.__exit__(None, None, None)


def _object_setattr_ignore_descriptor(obj: Any, name: str, value: Any) -> None:
    import threading

    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        if not isinstance(obj, threading.local):
            raise
        d = threading.local.__getattribute__(obj, "__dict__")
    d[name] = value


DYNAMO_UTILS_HELPERS: dict[str, Callable[..., Any]] = {
    "call_size": _call_size,
    "call_stride": _call_stride,
    "call_storage_offset": _call_storage_offset,
    "record_pregraph_bytecode_enter": _record_pregraph_bytecode_enter,
    "record_pregraph_bytecode_exit": _record_pregraph_bytecode_exit,
    "object_setattr_ignore_descriptor": _object_setattr_ignore_descriptor,
}


class LazyModule(types.ModuleType):
    """Stands in for a module that saved bytecode reads: known helpers without importing it.

    Any attribute not in ``helpers`` imports the real module (correct, only slower).
    """

    def __init__(self, name: str, helpers: dict[str, Callable[..., Any]]) -> None:
        super().__init__(name)
        self.__dict__.update(helpers)
        self._tessera_real = name

    def __getattr__(self, attr: str) -> Any:
        import importlib

        log.debug("saved bytecode reads %s.%s: importing %s", self._tessera_real, attr, self._tessera_real)
        return getattr(importlib.import_module(self._tessera_real), attr)


def module_for_bytecode(name: str) -> types.ModuleType:
    """The module object saved bytecode should see for ``name`` (Dynamo's own: a lazy stand-in)."""
    import importlib

    if name in sys.modules:
        return sys.modules[name]
    if name == "torch._dynamo.utils":
        return LazyModule(name, DYNAMO_UTILS_HELPERS)
    if name.startswith("torch._dynamo"):
        return LazyModule(name, {})
    return importlib.import_module(name)


# -- Inductor -----------------------------------------------------------------------------------
# Inductor config keys that never change generated code, or that tessera sets itself per
# process (the ISA probe result): kept out of cache keys (torch 2.11-2.13 names).
INDUCTOR_CONFIG_NOT_IN_KEY = frozenset({"cpp.vec_isa_ok", "post_grad_custom_post_pass"})


def inductor_config() -> Any:
    from torch._inductor import config

    return config


def inductor_config_names() -> set[str]:
    """Every Inductor setting's name (dotted for nested ones: ``cpp.simdlen``)."""
    return set(inductor_config().get_config_copy())


def inductor_config_repr() -> str:
    """The whole Inductor config as a string equal across processes with equal settings."""
    config = inductor_config()
    try:
        saved = config.save_config_portable()
    except Exception:  # older torch: the plain dict of settings
        saved = config.get_config_copy()
    return repr(
        sorted(
            (k, repr(v))
            for k, v in saved.items()
            if not k.startswith("_") and k not in INDUCTOR_CONFIG_NOT_IN_KEY
        )
    )


def inductor_config_overrides() -> str:
    """Inductor settings changed from their defaults, without importing Inductor.

    If the config module is not loaded, only ``TORCHINDUCTOR_*`` variables can have changed it.
    """
    env = sorted((k, v) for k, v in os.environ.items() if _inductor_env_changes_code(k))
    module = sys.modules.get("torch._inductor.config")
    changed: list[tuple[str, str]] = []
    entries = getattr(module, "_config", None) if module is not None else None
    if isinstance(entries, dict):
        # Reading a deprecated setting warns (torch 2.15: use_mixed_mm): we only compare values.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for name, entry in entries.items():
                if name.startswith("_") or name in INDUCTOR_CONFIG_NOT_IN_KEY or _no_default(entry):
                    continue
                with contextlib.suppress(Exception):
                    value = getattr(module, name)
                    if value != getattr(entry, "default", value):
                        changed.append((name, repr(value)))
    return repr((env, sorted(changed)))


def _no_default(entry: Any) -> bool:
    """Whether a config entry has no default of its own to compare with: an alias of another
    config (``force_disable_caches`` is ``torch.compiler.config``'s) or one whose default is
    torch's unset sentinel (a plain ``object()``). Its value differs from that "default" as soon as
    the other config loads, so counting it made the fingerprint depend on whether anything in the
    process had compiled yet: a second model in a process never found its warm artifact. Such an
    entry counts only when the user set it (``user_override``, a ContextVar on torch 2.13).
    """
    if getattr(entry, "alias", None) is not None:
        return True
    if type(getattr(entry, "default", None)) is not object:
        return False
    read = getattr(getattr(entry, "user_override", None), "get", None)
    value = read() if callable(read) else None
    return value is None or type(value) is object


def _inductor_env_changes_code(name: str) -> bool:
    """Whether a ``TORCHINDUCTOR_*`` variable can change generated code (caches, threads: no)."""
    if not name.startswith("TORCHINDUCTOR_"):
        return False
    return not any(word in name for word in ("CACHE", "THREADS", "WORKER", "TRACE", "DEBUG"))


def fresh_inductor_cache(directory: str) -> contextlib.AbstractContextManager[None]:
    """Inductor's caches (in memory and on disk) empty for the body, under ``directory``:
    ``torch._inductor.utils.fresh_cache`` (torch 2.11-2.15), as torch's own tests use it."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache(dir=directory)


def standalone_compile(
    graph: torch.fx.GraphModule, inputs: list[Any], dynamic_shapes: str, patches: dict[str, Any]
) -> Any:
    """``torch._inductor.standalone_compile`` across 2.11-2.13."""
    import inspect

    from torch._inductor import standalone_compile as compile_

    if "donate_graph_module" not in inspect.signature(compile_).parameters:
        # torch < 2.12 (seen on 2.11) may rewrite the graph it is given; we keep using ours for
        # fallbacks and dumps, so hand it a copy. Remove once 2.12 is the oldest supported torch.
        import copy

        graph = copy.deepcopy(graph)
    return compile_(
        graph,
        inputs,
        dynamic_shapes=dynamic_shapes,  # type: ignore[arg-type]
        options={"config_patches": patches},
    )


def preload_inductor() -> None:
    """Import what an Inductor standalone compile imports (about 3 s on a small CPU), so that a
    compile worker pays it while its parent is still tracing."""
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor import standalone_compile  # noqa: F401


def load_compiled_artifact(path: str) -> Any:
    """Inductor's own loader of a standalone-compile artifact (imports all of Inductor)."""
    from torch._inductor import CompiledArtifact  # type: ignore[attr-defined]

    return CompiledArtifact.load(path=path, format="binary")


def find_compiled_graph(artifact: Any) -> Any | None:
    """The ``CompiledFxGraph`` inside a standalone-compile artifact, or None.

    There is no public accessor (torch 2.11-2.13): walk the wrapper chain (closures and the
    ``compiled_fn`` / ``current_callable`` attributes) to the object holding the output code.
    """
    seen: set[int] = set()
    todo: list[Any] = [artifact]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or len(seen) > 500:
            continue
        seen.add(id(obj))
        if isinstance(getattr(obj, "source_code", None), str) and callable(
            getattr(obj, "current_callable", None)
        ):
            return obj
        for attr in ("_compiled_fn", "compiled_fn", "current_callable", "__wrapped__", "__func__"):
            value = getattr(obj, attr, None)
            if value is not None and not isinstance(value, (str, int, bool)):
                todo.append(value)
        for cell in getattr(obj, "__closure__", None) or ():
            with contextlib.suppress(ValueError):
                todo.append(cell.cell_contents)
    return None


def kernel_env() -> dict[str, str]:
    """What an Inductor C++ kernel module needs in the environment before it is loaded.

    torch 2.13 kernels find ``THPVariable_Unpack``-like helpers through this variable (set by
    ``CppPythonBindingsCodeCache``); torch 2.11 kernels need nothing.
    """
    guards = getattr(torch._C, "_dynamo", None)
    pointer = getattr(getattr(guards, "guards", None), "_torchinductor_pyobject_tensor_data_ptr", None)
    return {} if pointer is None else {"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": str(pointer)}


def extern_kernels() -> Any:
    """Inductor's namespace of extern kernels (``select_algorithm.extern_kernels``)."""
    from torch._inductor.select_algorithm import extern_kernels as namespace

    return namespace


@functools.cache
def vec_isa_candidates() -> tuple[str, ...]:
    """The vector ISAs the CPU flags claim (x86), widest first, without Inductor's build probe.

    ``cpu_vec_isa.valid_vec_isa_list`` (torch 2.11-2.13) also compiles and loads a test program
    per candidate in a subprocess (~1 s warm, ~8 s on an empty Inductor cache). Uses its
    ``supported_vec_isa_list`` and ``x86_isa_checker``; anything unexpected gives ().
    """
    try:
        import platform

        from torch._inductor import cpu_vec_isa

        if platform.machine() not in ("x86_64", "AMD64"):
            return ()
        flags = cpu_vec_isa.x86_isa_checker()
        return tuple(
            str(isa)
            for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())
        )
    except Exception as e:  # a torch without these helpers: never trust, always probe
        log.debug("cannot read the CPU's vector ISA candidates: %s", e)
        return ()


def picked_vec_isa() -> str:
    """The ISA Inductor generates CPU code for in this process (runs its probe if not yet run)."""
    from torch._inductor import cpu_vec_isa

    return str(cpu_vec_isa.pick_vec_isa())


@contextlib.contextmanager
def trusted_vec_isa(trust: bool) -> Iterator[None]:
    """Skip Inductor's per-process ISA probe when an earlier probe on this machine agreed with the flags."""
    if not trust:
        yield
        return
    with inductor_config().patch({"cpp.vec_isa_ok": True}):
        yield


def custom_graph_pass_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomGraphPass`` (torch 2.11-2.15): the base of a pass
    Inductor runs post-grad and keys its FX graph cache on (``uuid()``)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


# -- nn.Module hooks ----------------------------------------------------------------------------
# The hook dicts nn.Module.__call__ reads (torch 2.11-2.13, torch/nn/modules/module.py): tessera
# calls the root's forward directly, so it runs the root's hooks itself, in the same order.
def global_module_hooks() -> bool:
    return bool(
        nn_module._global_forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    )


def global_backward_hooks() -> bool:
    return bool(nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def forward_hooks(
    module: torch.nn.Module,
) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]], set[int], set[int]]:
    """(pre-hooks, hooks, pre-hook ids taking kwargs, hook ids taking kwargs), globals first."""
    from torch.nn.modules import module as nn_module

    pre_hooks = [*nn_module._global_forward_pre_hooks.items(), *module._forward_pre_hooks.items()]
    hooks = [*nn_module._global_forward_hooks.items(), *module._forward_hooks.items()]
    pre_with_kwargs = set(module._forward_pre_hooks_with_kwargs)
    with_kwargs = set(module._forward_hooks_with_kwargs) | set(nn_module._global_forward_hooks_with_kwargs)
    return pre_hooks, hooks, pre_with_kwargs, with_kwargs


# -- torch's structured trace (TORCH_TRACE, read by tlparse) ---------------------------------------
def trace_artifact(name: str, payload: Callable[[], str], in_compile: bool = True) -> None:
    """An artifact in torch's structured trace (``torch._logging.trace_structured``, 2.11-2.13).

    Costs a handler check when ``TORCH_TRACE`` is not set. ``in_compile``: emitted inside
    Dynamo's compile of the model (attributed to its compile id).
    """
    from torch._logging import trace_structured  # type: ignore[attr-defined]

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=payload,
        expect_trace_id=in_compile,
    )


def join_before_pools_shut(thread: threading.Thread) -> None:
    """Have the interpreter's exit wait for ``thread`` before thread and process pools refuse work.

    Reason: at exit, ``threading._shutdown`` runs its exit hooks before it joins non-daemon threads,
    and ``concurrent.futures``'s hook makes every pool refuse new work ("cannot schedule new futures
    after interpreter shutdown"). Inductor's compile submits to such pools, so a background compile
    still running when the main thread ends would fail. Hooks run last-registered first: the pool
    modules are imported before ours is registered, so ours runs before theirs.
    (``threading._register_atexit`` is private to CPython; without it, the compile may fail at exit,
    which is logged, and the next process compiles what is missing.)
    """
    import concurrent.futures.process
    import concurrent.futures.thread  # noqa: F401

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    with contextlib.suppress(RuntimeError):  # already shutting down: nothing left to order
        register(thread.join)
