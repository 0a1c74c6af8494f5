"""What the one trace assumed of a call, and the check of every later call against it.

Dynamo's guards are dropped, so tessera records at the first call what the trace depended on:
the call's structure (positional count, keyword names), each argument's type, dtype, device,
rank and static sizes, Python scalar values, and the Python state Dynamo read from argument
objects (a ``StaticCache`` layer's length). Later calls pass one generated tuple comparison; a
call that differs is explained by name, or normalised when only its syntax differs.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tessera.errors import TesseraError

# An expression Dynamo uses to name state it read from the call's arguments (after tessera's
# trampoline, the frame's locals are `args` and `kwargs`): subscripts and attributes only.
_STATE_EXPR = re.compile(r"^(args|kwargs)(\[(\d+|'[^'\\]*')\]|\.[A-Za-z_]\w*)+$")
_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)
_MAX_DEPTH = 3


class InputMismatchError(TesseraError):
    """A call differs from what the one trace assumed (the argument, assumption and value)."""


@dataclass(frozen=True)
class Assumption:
    """One thing the trace depended on: ``expr`` (over ``args``/``kwargs``) evaluates to ``expected``."""

    expr: str
    expected: Any
    label: str  # e.g. "input_ids: dtype"
    state: bool = False  # Python state Dynamo read from an argument object (a StaticCache length)


@dataclass(frozen=True)
class CallSpec:
    """The call the trace saw: its structure and every assumption the trace made of it."""

    num_args: int
    keywords: tuple[str, ...]
    assumptions: tuple[Assumption, ...]

    def mismatches(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[Assumption, Any]]:
        """Each assumption ``(args, kwargs)`` breaks, with the value found."""
        out = []
        wrong_type: list[str] = []  # paths whose type differs: their dtype etc. say nothing more
        for assumption in self.assumptions:
            if any(_about(assumption.expr, p) for p in wrong_type):
                continue
            try:
                found = eval(
                    assumption.expr, {}, {"args": args, "kwargs": kwargs}
                )  # expressions of our grammar only
            except Exception as e:  # a missing attribute, an index out of range
                found = _Missing(f"{type(e).__name__}: {e}")
            if not _same(found, assumption.expected):
                out.append((assumption, found))
                if assumption.expr.startswith("type(") and assumption.expr.endswith(")"):
                    wrong_type.append(assumption.expr[5:-1])
        return out


def _about(expr: str, path: str) -> bool:
    """Whether ``expr`` reads ``path`` (``args[1].dtype``, ``len(args[1])``; not ``args[10]``)."""
    return f"({path})" in expr or (
        expr.startswith(path) and expr[len(path) : len(path) + 1] in ("", ".", "[")
    )


class _Missing:
    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"<not readable: {self.why}>"


def _same(found: Any, expected: Any) -> bool:
    try:
        return bool(type(found) is type(expected) and found == expected)
    except Exception:
        return False


def record(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    names: Callable[[str], str],
    dynamic: Callable[[str], frozenset[int]],
    state: Sequence[tuple[str, Any]] = (),
    shape_guards: Sequence[str] = (),
    dynamic_state: Sequence[str] = (),
) -> CallSpec:
    """The spec of the first call: ``names(path)`` gives an argument's name, ``dynamic(path)`` its
    dynamic dims; ``state`` holds ``(expression, value)`` pairs Dynamo guarded on. Of Dynamo's
    symbolic guards, those on ``dynamic_state`` (argument ints traced as symbols) are kept; those on
    tensor sizes are not: a dynamic dim is trusted as documented (trace once means trace once)."""
    assumptions: list[Assumption] = []
    for i, value in enumerate(args):
        assumptions.extend(_describe(f"args[{i}]", value, names(f"args[{i}]"), dynamic, 0))
    for key, value in kwargs.items():
        path = f"kwargs[{key!r}]"
        assumptions.extend(_describe(path, value, names(path), dynamic, 0))
    seen = {a.expr for a in assumptions}
    for expr, value in state:
        if expr in seen or not _STATE_EXPR.match(expr) or not isinstance(value, _SCALARS):
            continue
        seen.add(expr)
        assumptions.append(Assumption(expr, value, _label(expr, names), state=True))
    for guard in shape_guards:
        local = local_expression(guard)
        if local is None or local in seen:
            continue
        about = [s for s in dynamic_state if s in local]
        if about:
            seen.add(local)
            assumptions.append(Assumption(local, True, f"{_label(about[0], names)}: {local}", state=True))
    return CallSpec(len(args), tuple(kwargs), tuple(assumptions))


_GUARD_NODES = (
    ast.Expression,
    ast.Compare,
    ast.BoolOp,
    ast.BinOp,
    ast.UnaryOp,
    ast.Subscript,
    ast.Attribute,
    ast.Name,
    ast.Constant,
    ast.Load,
    ast.cmpop,
    ast.boolop,
    ast.operator,
    ast.unaryop,
)


def local_expression(code: str) -> str | None:
    """A Dynamo guard (``L['kwargs']['c'].n <= 63``) over ``args``/``kwargs``, or None if it uses
    anything but sources, numbers, arithmetic and comparisons."""
    try:
        tree = ast.parse(code, mode="eval")
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not isinstance(node, _GUARD_NODES):
            return None
        if isinstance(node, ast.Name) and node.id != "L":
            return None

    class _Unroot(ast.NodeTransformer):
        def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
            root = node.value
            key = node.slice
            if (
                isinstance(root, ast.Name)
                and isinstance(key, ast.Constant)
                and key.value in ("args", "kwargs")
            ):
                return ast.copy_location(ast.Name(id=key.value, ctx=ast.Load()), node)  # type: ignore[attr-defined]
            self.generic_visit(node)
            return node

    unrooted = ast.unparse(_Unroot().visit(tree))
    return None if re.search(r"\bL\b", unrooted) else unrooted


def _label(expr: str, names: Callable[[str], str]) -> str:
    root = re.match(r"^(args\[\d+\]|kwargs\['[^']*'\])", expr)
    if root is None:
        return expr
    return names(root.group(1)) + expr[root.end() :]


def _describe(
    path: str, value: Any, name: str, dynamic: Callable[[str], frozenset[int]], depth: int
) -> Iterator[Assumption]:
    if isinstance(value, torch.Tensor):
        yield Assumption(f"type({path})", type(value), f"{name}: type")
        yield Assumption(f"{path}.dtype", value.dtype, f"{name}: dtype")
        yield Assumption(f"{path}.device", value.device, f"{name}: device")
        yield Assumption(f"{path}.dim()", value.dim(), f"{name}: number of dims")
        dims = dynamic(path)
        for d, size in enumerate(value.shape):
            if d not in dims:
                yield Assumption(f"{path}.shape[{d}]", int(size), f"{name}: size of dim {d} (static)")
    elif isinstance(value, _SCALARS):
        # The type too: the check compares with ==, and 2 == 2.0 == True, though the trace of
        # `x * alpha` gives an int tensor for one and a float tensor for the other.
        yield Assumption(f"type({path})", type(value), f"{name}: type")
        yield Assumption(path, value, f"{name}: value")
    elif isinstance(value, (tuple, list)) and depth < _MAX_DEPTH:
        yield Assumption(f"type({path})", type(value), f"{name}: type")
        yield Assumption(f"len({path})", len(value), f"{name}: length")
        for i, item in enumerate(value):
            yield from _describe(f"{path}[{i}]", item, f"{name}[{i}]", dynamic, depth + 1)
    elif type(value) is dict and depth < _MAX_DEPTH and all(isinstance(k, str) for k in value):
        yield Assumption(f"tuple({path})", tuple(value), f"{name}: keys")
        for key, item in value.items():
            yield from _describe(f"{path}[{key!r}]", item, f"{name}[{key!r}]", dynamic, depth + 1)
    else:
        yield Assumption(f"type({path})", type(value), f"{name}: type")


def make_checked_call(
    spec: CallSpec,
    call: Callable[..., Any],
    slow: Callable[[tuple[Any, ...], dict[str, Any]], Any],
) -> Callable[..., Any]:
    """``call`` behind one generated comparison; calls that fail it go to ``slow(args, kwargs)``."""
    exprs = [a.expr for a in spec.assumptions]
    source = (
        "def checked(*args, **kwargs):\n"
        "    try:\n"
        f"        ok = len(args) == {spec.num_args} and kwargs.keys() == _KEYS"
        + (f" and ({', '.join(exprs)},) == _EXPECTED" if exprs else "")
        + "\n"
        "    except Exception:\n"
        "        ok = False\n"
        "    if ok:\n"
        "        return _call(*args, **kwargs)\n"
        "    return _slow(args, kwargs)\n"
    )
    namespace: dict[str, Any] = {
        "_KEYS": frozenset(spec.keywords),
        "_EXPECTED": tuple(a.expected for a in spec.assumptions),
        "_call": call,
        "_slow": slow,
    }
    exec(compile(source, "<tessera call check>", "exec"), namespace)  # our own generated source
    return namespace["checked"]  # type: ignore[no-any-return]


def normalise(
    signature: inspect.Signature, spec: CallSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call rewritten in the traced call's structure (positional vs keyword), or
    InputMismatchError naming an argument the trace did not see (or saw and this call lacks)."""
    params = list(signature.parameters.values())
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise InputMismatchError(f"the call does not match the model's signature {signature}: {e}") from e
    values = dict(bound.arguments)
    var_positional = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
    var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    extra_keywords = dict(values.pop(var_keyword, {})) if var_keyword else {}
    positional: list[Any] = []
    for param in params:
        if len(positional) >= spec.num_args:
            break
        if param.kind is param.VAR_POSITIONAL:
            positional.extend(values.pop(param.name, ()))
        elif param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            if param.name in values:
                positional.append(values.pop(param.name))
            elif param.default is not param.empty:
                positional.append(param.default)
    if var_positional is not None:
        values.pop(var_positional, None)
    keywords: dict[str, Any] = {}
    for key in spec.keywords:
        if key in values:
            keywords[key] = values.pop(key)
        elif key in extra_keywords:
            keywords[key] = extra_keywords.pop(key)
        elif key in signature.parameters and signature.parameters[key].default is not inspect.Parameter.empty:
            keywords[key] = signature.parameters[key].default
        else:
            raise InputMismatchError(
                f"argument {key!r}: the first call passed it, this call does not; tessera traced the "
                "model once for the first call's arguments. Pass it, or compile another instance for "
                "calls without it"
            )
    leftover = {**values, **extra_keywords}
    for key, value in leftover.items():
        declared = signature.parameters.get(key)
        if declared is not None and declared.default is not declared.empty and _same(value, declared.default):
            continue  # passed explicitly with its default: what the trace saw
        raise InputMismatchError(
            f"argument {key!r}: the first call left it out, this call passes {_short(value)}; "
            "tessera traced the model once without it, so it would be ignored. Pass it in the first "
            "call too, compile another instance for calls with it, or use mode='stock'"
        )
    if len(positional) != spec.num_args:
        raise InputMismatchError(
            f"the first call passed {spec.num_args} positional argument(s), this call {len(positional)}"
        )
    return tuple(positional), keywords


def explain(mismatches: Sequence[tuple[Assumption, Any]]) -> str:
    """One message for the first broken assumption (and how many more there are)."""
    assumption, found = mismatches[0]
    more = f" ({len(mismatches) - 1} more difference(s))" if len(mismatches) > 1 else ""
    if "size of dim" in assumption.label:
        advice = "mark that dim dynamic (dynamic_dims={...}), compile another instance for this shape"
    elif assumption.state:
        advice = "compile another instance for this state"
    else:
        advice = "convert the input to what the first call passed, or compile another instance for it"
    return (
        f"{assumption.label}: the trace assumed {_short(assumption.expected)}, this call has "
        f"{_short(found)}{more}. tessera traces a model once and does not re-check Dynamo's guards: "
        f"{advice}, or use mode='stock'"
    )


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    if isinstance(value, type):
        return value.__qualname__
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def argument_names(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, str]:
    """``args[i]`` / ``kwargs['k']`` -> the parameter name a user knows it by."""
    names: dict[str, str] = {f"kwargs[{key!r}]": key for key in kwargs}
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    for i in range(len(args)):
        param = positional[min(i, len(positional) - 1)] if positional else None
        if param is None:
            names[f"args[{i}]"] = f"argument {i}"
        elif param.kind is param.VAR_POSITIONAL:
            names[f"args[{i}]"] = f"{param.name}[{i - positional.index(param)}]"
        else:
            names[f"args[{i}]"] = param.name
    return names
