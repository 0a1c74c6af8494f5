"""The guard-free Dynamo wrapper: trace a function once, then run Dynamo's bytecode directly.

Owns dynamic-dim choice and marking, the single ``torch.compile`` call, and what a failed trace is
blamed on; the transformed code object's portable form is ``portable.py``'s.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import logging
import re
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera import _compat
from tessera.errors import (
    CallArgumentsError,
    ConfigError,
    SizeFixedError,
    TesseraError,
    UnsupportedArgumentError,
    UnsupportedModelError,
)

log = logging.getLogger(__name__)
# Dynamo installs each trace's compiled graph in its entry frame's globals (``entry_frame``).
atexit.register(_compat.keep_dynamo_names_at_exit, __name__)

DynamicDims = Mapping[str, int | tuple[int, ...]]


def split_callable(fn: Callable[..., Any]) -> tuple[types.FunctionType, object | None]:
    """The plain function behind ``fn`` and the object it is bound to (a module's forward)."""
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward
    bound_to = None
    if isinstance(fn, types.MethodType):
        bound_to, fn = fn.__self__, fn.__func__
    if not isinstance(fn, types.FunctionType):
        raise ConfigError(f"tessera.compile needs an nn.Module or a Python function, got {type(fn).__name__}")
    return fn, bound_to


@dataclass(frozen=True)
class DynamicChoice:
    """The dims a call makes dynamic: ``(argument name, dim)`` pairs, and whether they were guessed."""

    dims: tuple[tuple[str, int], ...]
    guessed: bool  # default dims (dim 0 of every tensor): Dynamo may keep them static


def bind_arguments(
    func: types.FunctionType, bound_to: object | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call's arguments by name (``**kwargs`` entries under their own names)."""
    signature = inspect.signature(func)
    call_args = (bound_to, *args) if bound_to is not None else args
    try:
        bound = signature.bind(*call_args, **kwargs)
    except TypeError as e:
        raise CallArgumentsError(f"arguments do not match {func.__qualname__}{signature}: {e}") from e
    values = dict(bound.arguments)
    if bound_to is not None:
        values.pop(next(iter(signature.parameters)))
    var_keyword = _var_keyword(signature)
    if var_keyword is not None:  # forward(..., **kwargs): keyword tensors count by their own name
        values.update(values.pop(var_keyword, {}))
    return values


def _var_keyword(signature: inspect.Signature) -> str | None:
    return next(
        (p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
    )


def choose_dynamic_dims(
    func: types.FunctionType, values: Mapping[str, Any], dynamic_dims: DynamicDims | None
) -> DynamicChoice:
    """Which dims to keep symbolic (default: dim 0 of every Tensor argument). Touches no tensor."""
    signature = inspect.signature(func)
    if dynamic_dims is None:
        wanted: dict[str, tuple[int, ...]] = {
            name: (0,) for name, v in values.items() if isinstance(v, torch.Tensor) and v.dim()
        }
    else:
        unknown = sorted(set(dynamic_dims) - set(signature.parameters))
        if unknown and _var_keyword(signature) is None:
            raise ConfigError(
                f"dynamic_dims names {unknown}, but {func.__qualname__} takes {list(signature.parameters)}"
            )
        wanted = {
            name: (dims,) if isinstance(dims, int) else tuple(dims)
            for name, dims in dynamic_dims.items()
            if name in values
        }
    chosen = []
    for name, dims in wanted.items():
        value = values[name]
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"dynamic_dims[{name!r}]: argument is a {type(value).__name__}, not a Tensor")
        for dim in dims:
            if not -value.dim() <= dim < value.dim():
                raise ConfigError(
                    f"dynamic_dims[{name!r}]={dim} is out of range for a {value.dim()}-d tensor"
                )
            chosen.append((name, dim % value.dim()))
    return DynamicChoice(tuple(chosen), guessed=dynamic_dims is None)


def mark_dynamic(values: Mapping[str, Any], choice: DynamicChoice, mode: str = "backed") -> None:
    """Tell Dynamo about the chosen dims (before the one trace).

    ``mode="unbacked"`` marks them unbacked: no 0/1 specialisation, so the first call may have any
    size, at the price of guard-free reasoning only (data-dependent branches fail to trace).
    """
    dynamo = _compat.dynamo()
    for name, dim in choice.dims:
        if mode == "unbacked":
            _compat.mark_unbacked(values[name], dim)
        elif choice.guessed:
            # Default dims are a guess (a weight passed as an argument has a fixed dim 0):
            # let Dynamo keep them static where the code requires it.
            dynamo.maybe_mark_dynamic(values[name], dim)
        else:
            dynamo.mark_dynamic(values[name], dim)


def _entry(target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return target(*args, **kwargs)


# The globals entry_frame starts each copy with. Every other global its transformed code reads was
# installed by Dynamo: the compiled graph, an alias per module the model's code reads globals of
# (``__import_<module>``, ``__import___main__`` for a model defined in the user's script), and
# objects it had no source for.
ENTRY_GLOBALS = frozenset({"__builtins__", "__name__"})


def entry_frame() -> types.FunctionType:
    """A fresh copy of the frame tessera traces: it calls the model, so Dynamo inlines the model's
    forward even where that lives in torch (``nn.Sequential``), and the root's hooks stay out of the
    graph (hooks.py runs them). One copy per model: Dynamo keeps its state per code object, and
    installs its compiled graph and module aliases in the frame's globals, so each copy has its own
    globals too (a module's shared dict would mix models, and Dynamo refuses an alias it finds
    already bound to something else)."""
    namespace = {"__builtins__": _entry.__globals__["__builtins__"], "__name__": __name__}
    assert namespace.keys() == ENTRY_GLOBALS, "portable.capture_code tells Dynamo's globals from these"
    return types.FunctionType(_entry.__code__.replace(), namespace, "tessera_entry")


@dataclass(frozen=True)
class Trace:
    """The one trace: the first output, the bytecode as a plain function, and what Dynamo assumed."""

    output: Any
    call: Callable[..., Any]  # call(target, *args, **kwargs): Dynamo's bytecode, no frame evaluation
    code: types.CodeType
    guards: Any  # what ``on_guards`` made of Dynamo's guards, before the first call ran


# on_guards(facts, symbols, writes, not_at_one): Dynamo's guards; per graph input, each dim's
# symbol (None: static); whether the graph writes in place to anything; the symbols the graph
# treats differently at size 1 (see size_one_symbols).
GuardReader = Callable[
    [list[_compat.GuardFact], dict[str, tuple[str | None, ...]], bool, frozenset[str]], Any
]


def trace_once(
    entry: types.FunctionType,
    backend: Callable[..., Any],
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str,
    on_guards: GuardReader,
    dynamic_state: tuple[str, ...] = (),
    size_oblivious: bool = False,
    run: bool = True,
) -> Trace:
    """Trace ``entry(target, *args, **kwargs)`` with every guard dropped, after ``on_guards`` has
    read them (Dynamo builds guards after the graph is compiled and before the first call runs,
    so what it reads is the call's state before the model changed anything).

    ``dynamic_state`` names Python ints of the arguments' objects (``kwargs['cache'].length``)
    to trace as symbols: state that changed between calls (see api.py).

    The returned callable runs the bytecode Dynamo produced (graph call plus input/output
    plumbing) as a plain function, so later calls never enter Dynamo's frame evaluation.

    ``run=False`` ends the trace once the guards are read, before the frame runs: the trace's
    output is None, and the call's side effects are not made (eager made them: see beside.py).
    """
    code = entry.__code__
    captured: list[types.CodeType] = []
    symbolic: dict[str, tuple[str | None, ...]] = {}
    read: list[Any] = []
    failed: list[BaseException] = []

    def hook(old: types.CodeType, new: types.CodeType) -> None:
        if old is code:
            captured.append(new)

    writes: list[bool] = []
    not_at_one: set[str] = set()
    # Reason: torch 2.13-2.15 never free the callback of a compile whose guard filter raised
    # (NotRun, TraceAgain: a reference held in C), nor what the two functions given to
    # torch.compile reach. They reach it through ``live``, emptied after the trace, so the callback
    # keeps them alone, not the backend, the guards read and the model behind them.
    live: dict[str, Any] = {"backend": backend, "on_guards": on_guards, "symbolic": symbolic, "read": read}
    live.update(failed=failed, writes=writes, not_at_one=not_at_one)

    def inputs_then_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        live["symbolic"].update(_compat.placeholder_dims(gm))
        live["writes"].append(graph_writes_in_place(gm))
        live["not_at_one"].update(size_one_symbols(gm))
        with _compat.compile_guards_ignored(example_inputs):
            return live["backend"](gm, example_inputs)

    def drop_guards(entries: list[Any]) -> list[bool]:
        # Every guard is dropped; on_guards turns them into tessera's call check first.
        try:
            facts = [_compat.guard_fact(e) for e in entries]
            writes_any, at_one = any(live["writes"]), frozenset(live["not_at_one"])
            live["read"].append(live["on_guards"](facts, live["symbolic"], writes_any, at_one))
        except TraceAgain:
            _compat.guard_build_abandoned()
            raise  # before the frame runs: the call's side effects happen once, in the next trace
        except Exception as e:  # raised after the trace: Dynamo would bury it in its own error
            live["failed"].append(e)
        if not run:
            _compat.guard_build_abandoned()
            raise NotRun  # Dynamo builds the guards after its bytecode hooks: the code is captured
        return [False] * len(entries)

    compiled = torch.compile(
        entry,
        backend=inputs_then_backend,
        fullgraph=True,
        dynamic=False,
        options={"guard_filter_fn": drop_guards},
    )
    handle = _compat.register_bytecode_hook(hook)
    try:
        # A failure is raised to tessera (retried, or raised in eager's words): torch's own log
        # lines about it stay off stderr.
        with _compat.single_trace_settings(dynamic_state, size_oblivious), _compat.trace_failure_logs_quiet():
            output = _traced_call(compiled, target, args, kwargs)
    except NotRun:
        output = None
    except _compat.trace_errors() as e:
        # Users asked for the cause and the source line, not Dynamo's stack: the original error
        # stays reachable as .dynamo_error instead of being printed as the cause.
        blamed = argument_blamed(e, target, args, kwargs)
        error = UnsupportedModelError(describe_trace_failure(name, e))
        if blamed is not None:
            refused = UnsupportedArgumentError(describe_argument_failure(name, e, *blamed))
            refused.argument, error = blamed[0], refused
        error.dynamo_error = e
        raise error from None
    except _compat.constraint_violation_error() as e:
        first = str(e).strip().splitlines()
        raise SizeFixedError(
            f"{name}: the code fixes the size of a dim traced as dynamic "
            f"({first[0] if first else type(e).__name__})"
        ) from e
    except TraceAgain:
        raise
    except Exception as e:
        # Our backend's own errors (a ConfigError about compile_sizes) reach the user as they are,
        # not wrapped in Dynamo's BackendCompilerFailed, chained to their own cause as raised.
        inner = _compat.backend_failure(e)
        if isinstance(inner, TesseraError):
            raise inner from inner.__cause__
        raise
    finally:
        live.clear()
        handle.remove()
        # Our entry has no guards: left in place it would serve any later call of this frame.
        _compat.reset_code(code)
    if failed:
        raise failed[0]
    if not captured or not read:
        raise UnsupportedModelError(f"Dynamo did not trace {name}; tessera needs the forward in one graph")
    return Trace(output, _as_function(captured[-1], entry), captured[-1], read[-1])


# Ops whose result depends on whether a size is 1, decided inside torch where no guard is left:
# traced size-obliviously, ``x.squeeze()`` keeps a symbolic dim (as if it were not 1).
_SIZE_ONE_OPS = frozenset({"squeeze", "squeeze_"})


def size_one_symbols(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The size symbols Dynamo's graph passes to an op that behaves differently at size 1.

    A size-oblivious trace (``_compat.single_trace_settings``) makes Python's decisions on a size
    guards (``if x.shape[0] > 1`` becomes ``2 <= x.size()[0]``, checked per call) and decides
    inside torch as if the size were not 0 or 1: right at 1 for every op but those that drop or
    keep a dim by its size. Those are found here, and their sizes bounded to >= 2 (traces.py)."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if name not in _SIZE_ONE_OPS or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        value = node.args[0].meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            continue
        dims: Any = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if dims is None:
            dims = range(value.dim())
        elif isinstance(dims, int):
            dims = (dims,)
        for d in dims:
            if not isinstance(d, int) or not -value.dim() <= d < value.dim():
                continue
            size = value.shape[d]
            if isinstance(size, torch.SymInt):
                out.update(str(s) for s in _compat.sym_expr(size).free_symbols)
    return frozenset(out)


class NotRun(Exception):
    """Raised by the guard reader of a trace made with ``run=False``: the trace is complete, and
    the frame must not run."""


class TraceAgain(Exception):
    """Raised by a guard reader to end a trace before its frame runs (the call's side effects, a
    KV cache's writes, must happen once): the trace does not hold for the very call it was made
    from, and the caller traces again another way."""


def _traced_call(compiled: Callable[..., Any], target: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """``compiled(target, *args, **kwargs)``, with a TraceAgain or NotRun Dynamo wrapped unwrapped."""
    try:
        return compiled(target, *args, **kwargs)
    except (TraceAgain, NotRun):
        raise
    except Exception as e:
        cause: BaseException | None = e
        for _ in range(8):  # Dynamo wraps an error of a guard callback in its own
            if cause is None or isinstance(cause, (TraceAgain, NotRun)):
                break
            cause = cause.__cause__ or cause.__context__
        if isinstance(cause, (TraceAgain, NotRun)):
            try:
                raise cause from None
            finally:  # this frame, in the traceback, holding the error: a cycle (acyclic.py)
                cause = None
        raise


def graph_writes_in_place(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo's graph calls an in-place op (``x.add_(1)``, ``out=``): then an argument may
    be written, and a copy of it (to fix its layout) would lose the write. Conservative: any
    in-place call counts, whatever it writes to."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or "out" in node.kwargs:
            return True
    return False


def _as_function(code: types.CodeType, entry: types.FunctionType) -> Callable[..., Any]:
    return types.FunctionType(code, entry.__globals__, entry.__name__)


def _cause(error: BaseException) -> str:
    message = str(error).strip().splitlines()
    return next((line for line in message if line.strip()), type(error).__name__)


def describe_trace_failure(name: str, error: BaseException) -> str:
    """One paragraph naming the cause and the user source line, instead of a Dynamo stack dump."""
    cause = _cause(error)
    where = ""
    stack = getattr(error, "real_stack", None)
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return (
        f"{name} cannot be traced as one graph{where}. Cause: {cause}. "
        "tessera needs the whole forward in one graph: remove the graph break or data-dependent "
        "branch there, or use mode='stock'."
    )


# Values an argument may hold that Dynamo traces (or reads as constants): an argument of any other
# kind, used on the source line where a trace failed, is what the failure is blamed on.
_TRACEABLE = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_CONTAINERS = (list, tuple, dict, set, frozenset, torch.nn.Module)


def argument_blamed(
    error: BaseException, target: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[str, Any, str] | None:
    """(name, value, where) of the argument a failed trace stopped on, or None: an argument of a
    kind Dynamo does not trace (a generator, a lock, an open file; not a tensor, number, string,
    container or module) named on the forward's source line where Dynamo gave up. A failure on
    the values (a data-dependent branch) or on a line that names no such argument blames none."""
    if not isinstance(error, _compat.dynamo().exc.Unsupported) or _compat.raised_on_values(error):
        return None
    code = getattr(getattr(target, "__func__", target), "__code__", None)
    stack = getattr(error, "real_stack", None) or ()
    frame = next(
        (
            f
            for f in reversed(stack)
            if code is not None and f.filename == code.co_filename and f.name == code.co_name
        ),
        None,
    )
    if frame is None or not frame.line:
        return None
    try:
        bound = inspect.signature(target).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    values = dict(bound.arguments)
    var_keyword = _var_keyword(bound.signature)
    if var_keyword is not None:
        values.update(values.pop(var_keyword, {}))
    named = set(re.findall(r"[A-Za-z_]\w*", frame.line))
    for name, value in values.items():
        if name in named and not isinstance(value, _TRACEABLE + _CONTAINERS) and not _is_dataclass(value):
            return name, value, f"{frame.filename}:{frame.lineno}: {frame.line.strip()}"
    return None


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def describe_argument_failure(name: str, error: BaseException, argument: str, value: Any, where: str) -> str:
    """What an UnsupportedArgumentError says: the argument, where the trace stopped on it, why."""
    return (
        f"{name}: tessera cannot take argument {argument!r} (a {type(value).__module__}."
        f"{type(value).__qualname__}): Dynamo cannot trace what the forward does with it at {where}. "
        f"Cause: {_cause(error)}. Pass it in a form that traces (tensors, numbers, strings, and "
        "lists, tuples, dicts or dataclasses of them), keep it out of the forward's arguments, or "
        "use mode='stock'."
    )


@contextlib.contextmanager
def eager_errors_first(
    name: str,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    undo: Callable[[], None] | None = None,
) -> Iterator[None]:
    """A trace of the body that failed on the call's values (an op that raised on fake tensors,
    an exception the code raised: ``_compat.raised_on_values``) is the caller's error where eager
    rejects the call too: the call is run eagerly, under no_grad as it was traced, and eager's
    own exception is raised (the trace's error stays reachable as its ``__context__``, and is
    logged at DEBUG). Costs a forward, on this failure path only. Where eager runs it, the
    trace's error is raised as it was (a fault of the trace, not of the call). ``undo`` is called
    before eager's error is raised: what the failed trace changed is not kept for a bad call."""
    try:
        yield
    except Exception as e:
        if not _compat.raised_on_values(e):
            raise
        try:
            with torch.no_grad():
                target(*args, **kwargs)
        except Exception as eager:
            if undo is not None:
                undo()
            log.debug("%s: the trace failed (%s); eager rejects the call too: raising its error", name, e)
            raise eager from None
        log.debug("%s: the trace failed (%s), but eager runs the call", name, e)
        raise
