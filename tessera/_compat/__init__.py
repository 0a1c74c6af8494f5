"""Every private PyTorch API tessera touches, in one place, with the versions it was checked on.

Nothing here is imported eagerly: Dynamo and Inductor cost ~1 s to import, and a warm start from
the whole-model artifact needs neither. Each helper says which torch versions it was checked on
(2.11 and 2.13 unless noted) and what public API would let it go.

A package of parts (guards, tensors, shapes, bytecode, fx, inductor, runtime), each name used as
``_compat.<name>``: this module holds the torch version check and Dynamo's tracing settings, and
re-exports every part's names.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from tessera._compat.bytecode import (
    DYNAMO_UTILS_HELPERS as DYNAMO_UTILS_HELPERS,
    LazyModule as LazyModule,
    module_for_bytecode as module_for_bytecode,
)
from tessera._compat.fx import (
    compile_graph_now as compile_graph_now,
    graph_source as graph_source,
    isolate_compiling_flag as isolate_compiling_flag,
    isolate_fx_patches as isolate_fx_patches,
    isolate_fx_tracing as isolate_fx_tracing,
    isolate_fx_tracing_flag as isolate_fx_tracing_flag,
    settle_device_guards as settle_device_guards,
)
from tessera._compat.guards import (
    AUTOCAST_DEVICES as AUTOCAST_DEVICES,
    GuardFact as GuardFact,
    any_autocast as any_autocast,
    call_state as call_state,
    dynamo_source_name as dynamo_source_name,
    function_mode_depth as function_mode_depth,
    guard_build_abandoned as guard_build_abandoned,
    guard_code as guard_code,
    guard_fact as guard_fact,
    guard_globals as guard_globals,
    guard_profile_skipped as guard_profile_skipped,
    input_dims as input_dims,
    local_source_name as local_source_name,
    own_trace as own_trace,
    placeholder_dims as placeholder_dims,
    placeholder_values as placeholder_values,
)
from tessera._compat.inductor import (
    INDUCTOR_CONFIG_NOT_IN_KEY as INDUCTOR_CONFIG_NOT_IN_KEY,
    custom_graph_pass_base as custom_graph_pass_base,
    extern_kernels as extern_kernels,
    find_compiled_graph as find_compiled_graph,
    fresh_inductor_cache as fresh_inductor_cache,
    inductor_config as inductor_config,
    inductor_config_names as inductor_config_names,
    inductor_config_overrides as inductor_config_overrides,
    inductor_config_repr as inductor_config_repr,
    kernel_env as kernel_env,
    leave_rng_alone_where_loaded as leave_rng_alone_where_loaded,
    load_compiled_artifact as load_compiled_artifact,
    picked_vec_isa as picked_vec_isa,
    preload_inductor as preload_inductor,
    rng_is_left_alone as rng_is_left_alone,
    rng_left_alone as rng_left_alone,
    standalone_compile as standalone_compile,
    trusted_vec_isa as trusted_vec_isa,
    vec_isa_candidates as vec_isa_candidates,
)
from tessera._compat.runtime import (
    before_thread_joins as before_thread_joins,
    forward_hooks as forward_hooks,
    global_backward_hooks as global_backward_hooks,
    global_module_hooks as global_module_hooks,
    has_backward_hooks as has_backward_hooks,
    has_forward_hooks as has_forward_hooks,
    interpreter_exiting as interpreter_exiting,
    keep_dynamo_names_at_exit as keep_dynamo_names_at_exit,
    trace_artifact as trace_artifact,
)
from tessera._compat.shapes import (
    SymbolMaker as SymbolMaker,
    compile_assumptions as compile_assumptions,
    guard_baseline as guard_baseline,
    guard_check as guard_check,
    note_trace as note_trace,
    symbol_facts as symbol_facts,
    symbol_knowledge as symbol_knowledge,
)
from tessera._compat.tensors import (
    OpOverload as OpOverload,
    OpOverloadPacket as OpOverloadPacket,
    is_constant_symint as is_constant_symint,
    is_plain_tensor as is_plain_tensor,
    is_view as is_view,
    op_is_mutable as op_is_mutable,
    op_overload_name as op_overload_name,
    op_schema_name as op_schema_name,
    ops_of_the_users as ops_of_the_users,
    overload_of as overload_of,
    packet_name as packet_name,
    same_storage as same_storage,
    size_hint as size_hint,
    sym_expr as sym_expr,
    symbol_ranks as symbol_ranks,
    sympy_expression as sympy_expression,
    version_counter as version_counter,
)

log = logging.getLogger(__name__)

# Dynamo's prefix for a compiled graph installed in its module. Checked on torch 2.11, 2.13: private.
COMPILED_FN_PREFIX = "__compiled_fn"

# The torch releases this module was checked on (tests/test_compat.py, docs/versions.md).
# Checked on torch 2.11-2.15: outside this range UntestedTorchWarning fires; no private state read.
TESTED_TORCH = ((2, 11), (2, 15))


def torch_release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the installed torch), ``2.15.0+cpu`` -> (2, 15).
    Checked on torch 2.11, 2.13: reads the public ``torch.__version__`` only, nothing private."""
    match = re.match(r"^(\d+)\.(\d+)", version or torch.__version__)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def untested_torch(version: str | None = None) -> str | None:
    """Why the installed torch is outside the tested range (None when inside it).

    Checked on torch 2.11, 2.13: public ``torch.__version__`` against ``TESTED_TORCH``, nothing private.
    """
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
    """``torch._dynamo``, imported on first use (~0.6 s): only the tracing path needs it.

    Checked on torch 2.11, 2.13: the private module; ``torch.compiler`` lacks its config, exc, reset_code.
    """
    import torch._dynamo

    return torch._dynamo


# Used when Dynamo has no compile lock of its own (none of 2.11-2.15): compiles still serialise.
# Checked on torch 2.11-2.15: stands in for ``convert_frame.compile_lock``; no public lock exists.
_FALLBACK_COMPILE_LOCK = threading.RLock()


@functools.cache
def dynamo_compile_lock() -> Any:
    """Dynamo's process-wide compile lock (an RLock), held while it converts a frame and runs the
    backend: ``torch._dynamo.convert_frame.compile_lock`` (Inductor's backward compile takes it
    too). tessera's compiles take it so that no two compiles of a process overlap (see
    compile_state.COMPILE_LOCK). Imports Dynamo: call it on compile paths only.

    Checked on torch 2.11-2.15; no public API.
    """
    from torch._dynamo import convert_frame

    return getattr(convert_frame, "compile_lock", _FALLBACK_COMPILE_LOCK)


def holds_compile_lock() -> bool:
    """Whether this thread holds Dynamo's compile lock (``dynamo_compile_lock``), taken by
    Dynamo itself or through tessera. ``_is_owned`` is the C RLock's (CPython 3.10-3.13); a lock
    without it is taken as held (the caller then waits for nothing it might hold).

    Checked on torch 2.11-2.15 (the lock is a ``threading.RLock``); no public API.
    """
    owned = getattr(dynamo_compile_lock(), "_is_owned", None)
    return True if owned is None else bool(owned())


def register_bytecode_hook(hook: Callable[[types.CodeType, types.CodeType], None]) -> Any:
    """Call ``hook(original, transformed)`` for every frame Dynamo converts; returns a handle.

    Checked on torch 2.11, 2.13: ``torch._dynamo.convert_frame.register_bytecode_hook`` (no public
    API yet).
    """
    from torch._dynamo.convert_frame import register_bytecode_hook as register

    return register(hook)  # type: ignore[arg-type]


def default_stance() -> bool:
    """Whether ``torch.compiler.set_stance`` is at its default (tessera's eager first is off under
    any other stance: the user chose how compiled code runs).

    Checked on torch 2.11, 2.13: reads the private ``torch._dynamo.eval_frame._stance``; the public
    API sets the stance but has no getter. Dynamo is not imported for it (a second, before eager's
    first output): a stance is set through it, so without it the stance is the default."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    stance = getattr(eval_frame, "_stance", None)
    return getattr(stance, "stance", "default") == "default"


def reset_code(code: types.CodeType) -> None:
    """Drop Dynamo's compiled entries for one code object (``torch._dynamo.reset_code``).

    Checked on torch 2.11, 2.13; no public API (``torch.compiler.reset`` drops every code's entries).
    """
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

    Checked on torch 2.11, 2.13: patches private ``torch._dynamo.config`` and
    ``torch.fx.experimental._config``; only ``dynamic_sources`` is public. No guard timing.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(guard_profile_skipped())  # the GIL held 25 ms for a metric
        stack.enter_context(own_trace())  # a script's globals read as they are (cProfile)
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
    """Whether backed sizes are reasoned about size-obliviously now: set while tessera traces, and
    needed again by every compile of that trace. Checked on torch 2.11-2.15: the private
    ``torch.fx.experimental._config.backed_size_oblivious``; no public switch."""
    from torch.fx.experimental import _config as fx_config

    return bool(getattr(fx_config, "backed_size_oblivious", False))


@contextlib.contextmanager
def size_oblivious() -> Iterator[None]:
    """Backed sizes reasoned about as if >= 2 while a size-oblivious trace's graph is compiled:
    Inductor's own shape decisions would otherwise read a size-1 hint as the size and specialise
    the general artifact to it (a trace made at size 1 then served size 3 wrongly).
    Checked on torch 2.11, 2.13: patches the private ``torch.fx.experimental._config``; no public
    switch."""
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
    traced again, for the compiler's hint-based ``s > 1``). Checked on torch 2.11-2.15: private
    ``torch._guards.detect_fake_mode`` and ``ShapeEnv.suppress_guards``; no public API."""
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
    fakified): decisions made on the hint (Inductor's code generation) see a general size.
    Checked on torch 2.11-2.15: writes the private ``Tensor._dynamo_hint_overrides``; the public
    ``hint_override=`` of ``mark_dynamic`` / ``mark_unbacked`` sets it only with their own mark."""
    overrides = getattr(tensor, "_dynamo_hint_overrides", None)
    if overrides is None:
        overrides = {}
        tensor._dynamo_hint_overrides = overrides  # type: ignore[attr-defined]
    overrides[dim] = hint


def mark_unbacked(tensor: torch.Tensor, dim: int) -> None:
    """``torch._dynamo.decorators.mark_unbacked``: a dim traced as a size-free symbol.

    Checked on torch 2.11, 2.13; ``torch.compiler`` has no equivalent.
    """
    from torch._dynamo.decorators import mark_unbacked as mark

    mark(tensor, dim)


# What Dynamo's mark_dynamic / maybe_mark_dynamic / mark_unbacked leave on a tensor (torch
# 2.11-2.15, torch/_dynamo/decorators.py): attributes that outlive the call they were set for.
# Checked on torch 2.11-2.15: private tensor attributes; torch has no public way to clear a mark.
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
    caller's own torch.compile, or into another trace of the same tensor (one per size).
    Checked on torch 2.11-2.15: restores the private ``_DIM_MARKS``; no public way to clear a mark."""
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


def clear_dim_marks(tensors: list[torch.Tensor]) -> None:
    """Take tessera's dim marks off tensors it marked for one call.
    Checked on torch 2.11-2.15: removes the private ``_DIM_MARKS``; no public way to clear a mark."""
    for tensor in tensors:
        for name in _DIM_MARKS:
            tensor.__dict__.pop(name, None)


def supports_dynamic_state() -> bool:
    """Whether ``torch.compiler.config.dynamic_sources`` (public) exists, which traces chosen ints as
    symbols. Checked on torch 2.11, 2.13: present on both; the check guards any other torch."""
    return hasattr(torch.compiler.config, "dynamic_sources")


def trace_errors() -> tuple[type[BaseException], ...]:
    """Dynamo's errors for code that cannot be one graph (``Unsupported``, ``UserError``).

    Checked on torch 2.11, 2.13: private ``torch._dynamo.exc``; ``torch.compiler`` exports no errors.
    """
    exc = dynamo().exc
    return (exc.Unsupported, exc.UserError)


# Dynamo's graph-break kinds (``Unsupported.gb_type``, torch 2.13; the first line of the message
# on 2.11) that say an op or the code raised on the traced values: a TypeError or RuntimeError of
# an op run on fake tensors (``RuntimeError when making fake tensor call``), or an exception the
# code raised and nothing caught (``Observed exception``). Eager would most likely raise too.
# Checked on torch 2.11, 2.13: Dynamo's private graph-break wording; no public error kinds.
_RAISED_ON_VALUES = re.compile(r"^(Observed exception|\w+ when making fake tensor call)")


def raised_on_values(error: BaseException) -> bool:
    """Whether a failed trace failed because an op or the code raised on the call's values (what
    eager may raise as well: ``x @ w`` with the wrong sizes, ``None.view``), not because Dynamo
    cannot trace the code. ``error`` is Dynamo's, or an UnsupportedModelError holding it as
    ``dynamo_error``. Checked on torch 2.11, 2.13: ``TorchRuntimeError`` / ``Unsupported`` of the
    private ``torch._dynamo.exc``; no public error kinds."""
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
# eager's or tessera's words): fake_tensor's ``log.exception`` when a meta kernel raises (``x @ w``
# with the wrong sizes, or a size-oblivious trace a kernel refuses), and the one when an op raises
# TypeError; symbolic_shapes' warning when a guard fails to evaluate.
# Checked on torch 2.11, 2.13: torch's internal logger names and wording; no public switch.
_TRACE_FAILURE_LOGS: dict[str, tuple[str, ...]] = {
    "torch._subclasses.fake_tensor": (
        "failed while attempting to run meta for",
        "fake tensor raised TypeError",
    ),
    "torch.fx.experimental.symbolic_shapes": ("failed during evaluate_expr",),
}


class _TraceFailureLogs(logging.Filter):
    """Turns torch's log lines about a failure it raises into DEBUG lines of tessera's logger.

    Checked on torch 2.11, 2.13: matches torch's internal log wording (``_TRACE_FAILURE_LOGS``).
    """

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
    DEBUG (``TORCH_LOGS``), passes as before. A filter per logger, removed on the way out.
    Checked on torch 2.11, 2.13: torch's internal loggers (``_TRACE_FAILURE_LOGS``); no public
    switch."""
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
    """What a backend raised, when ``error`` is Dynamo's ``BackendCompilerFailed`` wrapping it.

    Checked on torch 2.11, 2.13: ``inner_exception`` of the private ``torch._dynamo.exc`` class,
    matched by name so that Dynamo is not imported; no public API.
    """
    if type(error).__name__ != "BackendCompilerFailed":
        return None
    return getattr(error, "inner_exception", None) or error.__cause__


def graph_compile_reason(gm: torch.fx.GraphModule) -> tuple[str, str, bool]:
    """Why Dynamo ended the graph it hands a backend: (reason, where in the user's code, whether
    it was a graph break). Where: the innermost frame outside torch, and torch's own frame after
    it when the break is inside torch. Read from ``gm.compile_subgraph_reason`` (a
    ``GraphCompileReason``). Checked on torch 2.11-2.15: set by Dynamo, no public accessor."""
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
    """What a trace raises when the code fixes a dim marked dynamic (``ConstraintViolationError``).

    Checked on torch 2.11, 2.13: ``torch.fx.experimental.symbolic_shapes``; no public name.
    """
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    return ConstraintViolationError


def traced_code_objects() -> list[types.CodeType] | None:
    """The code objects Dynamo traced for the graph being compiled, or None if unknown.

    ``TracingContext.get_traced_code()`` on torch 2.13; its ``traced_code`` list attribute on
    torch 2.11. Remove the fallback once 2.13 is the oldest supported torch.

    Checked on torch 2.11, 2.13: the private ``torch._guards.TracingContext``; no public API.
    """
    context = torch._guards.TracingContext
    getter = getattr(context, "get_traced_code", None)
    if getter is not None:
        return list(getter() or ())
    current = context.try_get()
    codes = getattr(current, "traced_code", None) if current is not None else None
    return list(codes) if codes else None
