"""The guard-free Dynamo wrapper: trace a function once, then call Dynamo's bytecode directly.

Owns dynamic-dim marking, the single ``torch.compile`` call and the captured code object.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch._dynamo
from torch._dynamo.convert_frame import register_bytecode_hook
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

from tessera.errors import ConfigError, UnsupportedModelError

log = logging.getLogger(__name__)

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


def mark_dynamic_dims(
    func: types.FunctionType,
    bound_to: object | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic_dims: DynamicDims | None,
) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Mark the dims Dynamo must keep symbolic; return them as ``(arg name, dim)`` pairs.

    Default: dim 0 of every Tensor argument.
    """
    signature = inspect.signature(func)
    call_args = (bound_to, *args) if bound_to is not None else args
    try:
        bound = signature.bind(*call_args, **kwargs)
    except TypeError as e:
        raise ConfigError(f"arguments do not match {func.__qualname__}{signature}: {e}") from e
    values = dict(bound.arguments)
    if bound_to is not None:
        values.pop(next(iter(signature.parameters)))
    var_keyword = next(
        (p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
    )
    if var_keyword is not None:  # forward(..., **kwargs): keyword tensors count by their own name
        values.update(values.pop(var_keyword, {}))
    if dynamic_dims is None:
        wanted: dict[str, tuple[int, ...]] = {
            name: (0,) for name, v in values.items() if isinstance(v, torch.Tensor) and v.dim()
        }
    else:
        unknown = sorted(set(dynamic_dims) - set(signature.parameters))
        if unknown and var_keyword is None:
            raise ConfigError(
                f"dynamic_dims names {unknown}, but {func.__qualname__} takes {list(signature.parameters)}"
            )
        wanted = {
            name: (dims,) if isinstance(dims, int) else tuple(dims)
            for name, dims in dynamic_dims.items()
            if name in values
        }
    marked = []
    for name, dims in wanted.items():
        value = values[name]
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"dynamic_dims[{name!r}]: argument is a {type(value).__name__}, not a Tensor")
        for dim in dims:
            if not -value.dim() <= dim < value.dim():
                raise ConfigError(
                    f"dynamic_dims[{name!r}]={dim} is out of range for a {value.dim()}-d tensor"
                )
            if dynamic_dims is None:
                # Default dims are a guess (a weight passed as an argument has a fixed dim 0):
                # let Dynamo keep them static where the code requires it.
                torch._dynamo.maybe_mark_dynamic(value, dim)
            else:
                torch._dynamo.mark_dynamic(value, dim)
            marked.append((name, dim % value.dim()))
    return marked, values


@contextlib.contextmanager
def _single_trace_settings() -> Iterator[None]:
    # One trace must never be refused for a full cache of earlier entries of this code. (Sizes
    # 0/1 need no setting here: api.py never traces at them, see CompiledModel._compile.)
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=4096):
        yield


def trace_once(
    func: types.FunctionType,
    bound_to: object | None,
    backend: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Callable[..., Any], types.CodeType]:
    """Trace ``func`` with every guard dropped; return the first output and a Dynamo-free callable.

    The callable runs the bytecode Dynamo produced (graph call plus input/output plumbing) as a
    plain function, so later calls never enter Dynamo's frame evaluation or guard checks.
    """
    code = func.__code__
    captured: list[types.CodeType] = []

    def hook(old: types.CodeType, new: types.CodeType) -> None:
        if old is code:
            captured.append(new)

    target = types.MethodType(func, bound_to) if bound_to is not None else func
    compiled = torch.compile(
        target,
        backend=backend,
        fullgraph=True,
        dynamic=False,
        options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
    )
    # Other compiled entries for this code object (another instance, a stock compile) would be
    # matched without guards; start from none so our trace really happens.
    torch._dynamo.reset_code(code)
    handle = register_bytecode_hook(hook)  # type: ignore[arg-type]
    try:
        with _single_trace_settings():
            output = compiled(*args, **kwargs)
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as e:
        # Users asked for the cause and the source line, not Dynamo's stack: the original error
        # stays reachable as .dynamo_error instead of being printed as the cause.
        error = UnsupportedModelError(describe_trace_failure(func, e))
        error.dynamo_error = e
        raise error from None
    except ConstraintViolationError as e:
        raise ConfigError(f"a dim in dynamic_dims cannot be dynamic: the code fixes its size. {e}") from e
    finally:
        handle.remove()
        # Our entry has no guards: left in place it would serve any later compile of this code.
        torch._dynamo.reset_code(code)
    if not captured:
        raise UnsupportedModelError(
            f"Dynamo did not trace {func.__qualname__} (it may be skipped as a torch/library "
            "function); wrap the model code in a function of your own"
        )
    fast = types.FunctionType(
        captured[-1], func.__globals__, func.__name__, func.__defaults__, func.__closure__
    )
    fast.__kwdefaults__ = func.__kwdefaults__
    call = types.MethodType(fast, bound_to) if bound_to is not None else fast
    return output, call, captured[-1]


def describe_trace_failure(func: types.FunctionType, error: Exception) -> str:
    """One paragraph naming the cause and the user source line, instead of a Dynamo stack dump."""
    message = str(error).strip().splitlines()
    cause = next((line for line in message if line.strip()), type(error).__name__)
    where = ""
    stack = getattr(error, "real_stack", None)
    if stack:
        frame = stack[-1]
        where = f" at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return (
        f"{func.__qualname__} cannot be traced as one graph{where}. Cause: {cause}. "
        "tessera needs the whole forward in one graph: remove the graph break or data-dependent "
        "branch there, or use mode='stock'."
    )
