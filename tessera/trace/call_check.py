"""What the one trace assumed of a call, and the check of every later call against it.

Dynamo's guards are dropped, so tessera records at the first call what the trace depended on:
the call's structure (positional count, keyword names), each argument's type, dtype, device,
rank and static sizes, Python scalar values, and the Python state Dynamo read from argument
objects (a ``StaticCache`` layer's length). Later calls pass one generated tuple comparison; a
call that differs is explained by name, or normalised when only its syntax differs.
"""

from __future__ import annotations

import ast
import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import Any

import torch

from tessera import _compat
from tessera.compilation.layout import layout_of
from tessera.errors import TesseraError
from tessera.serving.acyclic import define
from tessera.trace.assumption import Assumption, Kind, Mismatch

_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.device)
_MAX_DEPTH = 3


class InputMismatchError(TesseraError):
    """A call differs from what the one trace assumed (the argument, assumption and value)."""


class StateMismatchError(InputMismatchError):
    """A call runs under another global state (autocast, default dtype, a function mode) than the
    one the trace baked into its graph."""


class GradientsNotSupportedError(TesseraError):
    """A call whose result would need gradients: tessera compiles inference graphs only."""


@dataclass(frozen=True)
class CallSpec:
    """The call the trace saw: its structure, every assumption the trace made of it, the objects
    those read through (``parents``: ``_o{i}`` is the i-th expression over ``target`` and ``G``)
    and the global state it ran under (``_compat.call_state``)."""

    num_args: int
    keywords: tuple[str, ...]
    assumptions: tuple[Assumption, ...]
    parents: tuple[str, ...] = ()
    global_state: tuple[Any, ...] = ()
    writes_in_place: bool = False  # the graph writes in place: arguments are never copied

    def bind(self, target: Any, globals_: Mapping[str, Any]) -> dict[str, Any]:
        """The names the assumptions read besides ``args``/``kwargs``, resolved for ``target``.

        Raises InputMismatchError when the model no longer has what the trace read through."""
        bound: dict[str, Any] = {"target": target, "G": globals_, "_layout": layout_of}
        for i, parent in enumerate(self.parents):
            try:
                bound[f"_o{i}"] = eval(parent, {"__builtins__": __builtins__}, bound)  # our grammar
            except Exception as e:
                raise InputMismatchError(f"the model no longer has {parent} ({type(e).__name__}: {e})") from e
        return bound

    def mismatches(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        bound: Mapping[str, Any] | None = None,
        until: Callable[[Assumption], bool] | None = None,
    ) -> list[Mismatch]:
        """Each assumption ``(args, kwargs)`` breaks, with the value found; ``until``: stop at
        the first broken one it is true of (the caller needs no more)."""
        out = []
        wrong_type: list[str] = []  # paths whose type differs: their dtype etc. say nothing more
        names = {**(bound or {"_layout": layout_of}), "args": args, "kwargs": kwargs, "_key": _key}
        for assumption in self.assumptions:
            if any(_about(assumption.expr, p) for p in wrong_type):
                continue
            try:
                code = _key_safe_code(assumption.expr)  # our grammar
                found = eval(code, {"__builtins__": __builtins__}, names)
            except Exception as e:  # a missing attribute, an index out of range, a tensor for a dict
                found = _Missing(f"{type(e).__name__}: {e}")
            if not same_value(found, assumption.expected):
                out.append(Mismatch(assumption, found))
                if until is not None and until(assumption):
                    return out
                if assumption.kind is Kind.TYPE:
                    wrong_type.append(assumption.path)
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


def same_value(found: Any, expected: Any) -> bool:
    if found is expected:
        return True
    try:
        if type(found) is not type(expected):
            return False
        if isinstance(found, float) and math.isnan(found) and math.isnan(expected):
            return True  # NaN is the value the trace saw, though NaN != NaN
        return bool(found == expected)
    except Exception:
        return False


def record(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    names: Callable[[str], str],
    dynamic: Callable[[str], frozenset[int]],
    derived: Sequence[Assumption] = (),
    parents: Sequence[str] = (),
    global_state: Sequence[Any] = (),
    writes_in_place: bool = False,
) -> CallSpec:
    """The spec of the first call, taken before it runs: ``names(path)`` gives an argument's name,
    ``dynamic(path)`` its dynamic dims; ``derived`` are Dynamo's guards as assumptions
    (dynamo_guards.py), reading through ``parents``. The call's own structure (each argument's
    presence, type, scalar value) is described here too: it holds even where Dynamo read nothing."""
    assumptions: list[Assumption] = []
    for i, value in enumerate(args):
        assumptions.extend(_describe(f"args[{i}]", value, names(f"args[{i}]"), dynamic, 0))
    for key, value in kwargs.items():
        path = f"kwargs[{key!r}]"
        assumptions.extend(_describe(path, value, names(path), dynamic, 0))
    seen = {a.expr for a in assumptions}
    for assumption in derived:
        if assumption.expr not in seen:
            seen.add(assumption.expr)
            assumptions.append(assumption)
    return CallSpec(
        len(args), tuple(kwargs), tuple(assumptions), tuple(parents), tuple(global_state), writes_in_place
    )


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
    ast.Call,
    ast.Tuple,
    ast.List,
)
# Calls a guard may make: a tensor's size queries, and builtins over the sources.
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "dim", "numel"})
_GUARD_BUILTINS = frozenset({"hasattr", "len"})


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
        if isinstance(node, ast.Call):
            func = node.func
            if node.keywords or not (
                (isinstance(func, ast.Attribute) and func.attr in _GUARD_METHODS)
                or (isinstance(func, ast.Name) and func.id in _GUARD_BUILTINS)
            ):
                return None
        elif isinstance(node, ast.Name) and node.id != "L" and node.id not in _GUARD_BUILTINS:
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


def _describe(
    path: str, value: Any, name: str, dynamic: Callable[[str], frozenset[int]], depth: int
) -> Iterator[Assumption]:
    def of(expr: str, expected: Any, what: str, kind: Kind, dim: int | None = None) -> Assumption:
        return Assumption(expr, expected, f"{name}: {what}", kind, path, dim)

    if isinstance(value, torch.Tensor):
        yield of(f"type({path})", type(value), "type", Kind.TYPE)
        yield of(f"{path}.dtype", value.dtype, "dtype", Kind.DTYPE)
        yield of(f"{path}.device", value.device, "device", Kind.DEVICE)
        yield of(f"{path}.dim()", value.dim(), "number of dims", Kind.RANK)
        dims = dynamic(path)
        for d, size in enumerate(value.shape):
            if d not in dims:
                yield of(f"{path}.shape[{d}]", int(size), f"size of dim {d} (static)", Kind.SIZE, d)
    elif isinstance(value, _SCALARS):
        # The type too: the check compares with ==, and 2 == 2.0 == True, though the trace of
        # `x * alpha` gives an int tensor for one and a float tensor for the other.
        yield of(f"type({path})", type(value), "type", Kind.TYPE)
        yield of(path, value, "value", Kind.VALUE)
    elif isinstance(value, (tuple, list)) and depth < _MAX_DEPTH:
        yield of(f"type({path})", type(value), "type", Kind.TYPE)
        yield of(f"len({path})", len(value), "length", Kind.OTHER)
        for i, item in enumerate(value):
            yield from _describe(f"{path}[{i}]", item, f"{name}[{i}]", dynamic, depth + 1)
    elif type(value) is dict and depth < _MAX_DEPTH and all(isinstance(k, str) for k in value):
        yield of(f"tuple({path})", tuple(value), "keys", Kind.OTHER)
        for key, item in value.items():
            yield from _describe(f"{path}[{key!r}]", item, f"{name}[{key!r}]", dynamic, depth + 1)
    else:
        yield of(f"type({path})", type(value), "type", Kind.TYPE)


def _argument_chain(node: ast.AST) -> list[ast.Subscript] | None:
    """The subscripts from ``node`` down to the argument it reads (``kwargs['m']['k'].dtype``:
    ``['k']`` then ``['m']``), or None when it is not read from ``args``/``kwargs``."""
    chain: list[ast.Subscript] = []
    while True:
        if isinstance(node, ast.Subscript):
            chain.append(node)
            node = node.value
        elif isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
            node = node.func.value  # ``x.size()[0]``
        else:
            return chain if isinstance(node, ast.Name) and node.id in ("args", "kwargs") else None


def _is_key(node: ast.Subscript) -> bool:
    return isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)


@functools.lru_cache(maxsize=4096)
def _key_depth(expr: str) -> int:
    """How many string keys ``expr`` reads below an argument (``kwargs['mask']['full']``: 1)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return 0
    depth = 0
    for node in ast.walk(tree):
        chain = _argument_chain(node) if isinstance(node, ast.Subscript) else None
        if chain:  # the last subscript of a chain is the argument itself (``kwargs['mask']``)
            depth = max(depth, sum(_is_key(n) for n in chain[:-1]))
    return depth


def _key(container: Any, key: str) -> Any:
    """``container[key]``, refused for a tensor (torch warns before it fails on a string)."""
    if isinstance(container, torch.Tensor):
        raise TypeError(f"a tensor, not a dict with key {key!r}")
    return container[key]


@functools.lru_cache(maxsize=4096)
def _key_safe(expr: str) -> str:
    """``expr`` with each string key below an argument read through ``_key``: evaluated on a
    call that passes a tensor where the trace saw a dict, it fails without torch's warning."""
    if _key_depth(expr) == 0:
        return expr

    class _Keys(ast.NodeTransformer):
        def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
            chain = _argument_chain(node)  # before the keys inside it are rewritten
            self.generic_visit(node)
            if not chain or len(chain) < 2 or not _is_key(node):
                return node
            call = ast.Call(
                func=ast.Name(id="_key", ctx=ast.Load()), args=[node.value, node.slice], keywords=[]
            )
            return ast.copy_location(call, node)

    return ast.unparse(_Keys().visit(ast.parse(expr, mode="eval")))


@functools.lru_cache(maxsize=4096)
def _key_safe_code(expr: str) -> CodeType:
    """``_key_safe(expr)`` compiled, once per expression: a call no trace covers evaluates every
    assumption of every entry (trace_route.covering), hundreds per call, and compiling each from
    its text every time was most of such a call's cost (a tiny BERT's)."""
    return compile(_key_safe(expr), "<tessera assumption>", "eval")


def read_path(path: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """The value at ``path`` (``kwargs['mask']['full']``, our grammar) of a call; raises where the
    call has none there (a tensor where the trace saw a dict: without torch's warning)."""
    return eval(_key_safe_code(path), {"__builtins__": {}}, {"args": args, "kwargs": kwargs, "_key": _key})


def _check_source(spec: CallSpec) -> str:
    """The one boolean expression over ``args``/``kwargs`` (and the namespace of _check_namespace)
    that says a call is the traced one. The assumptions are compared in stages (``_stages``), so
    that a dict argument's entries are read only once its keys are the traced ones."""
    autocast = (spec.global_state or _compat.call_state())[0]
    state = (
        "_call_state() == _STATE"
        if autocast
        else "not _any_autocast() and _default_dtype() is _DTYPE and _modes() == _MODES"
    )
    return f"not _grad() and {state} and len(args) == {spec.num_args} and kwargs.keys() == _KEYS" + "".join(
        f" and ({', '.join(a.expr for a in stage)},) == _EXPECTED{i}" for i, stage in enumerate(_stages(spec))
    )


def _stages(spec: CallSpec) -> list[list[Assumption]]:
    """The assumptions by how many string keys they read below an argument: ``kwargs['mask']
    ['full']`` comes after ``tuple(kwargs['mask'])`` (the dict's keys), so a call passing a tensor
    there never indexes it with a string (torch warns of "a non-tuple sequence for
    multidimensional indexing" before it fails). Within each, those on the call's arguments come
    before those on the model and its globals: a call of another size fails at the first tuple,
    not after reading hundreds of the model's attributes (tiny BERT: 0.2 ms of each call no entry
    covers, and of each call routed past an entry it is not for)."""
    stages: list[list[Assumption]] = []
    for assumption in spec.assumptions:
        depth = 2 * _key_depth(assumption.expr) + (_ARGUMENTS.search(assumption.expr) is None)
        while len(stages) <= depth:
            stages.append([])
        stages[depth].append(assumption)
    return [stage for stage in stages if stage]


_ARGUMENTS = re.compile(r"\b(args|kwargs)\b")


def _check_namespace(spec: CallSpec, bound: Mapping[str, Any]) -> dict[str, Any]:
    _, default_dtype, modes = spec.global_state or _compat.call_state()
    return {
        **bound,
        "_KEYS": frozenset(spec.keywords),
        **{f"_EXPECTED{i}": tuple(a.expected for a in stage) for i, stage in enumerate(_stages(spec))},
        "_grad": torch.is_grad_enabled,
        "_any_autocast": _compat.any_autocast(),
        "_default_dtype": torch.get_default_dtype,
        "_modes": _compat.function_mode_depth(),
        "_call_state": _compat.call_state,
        "_STATE": tuple(spec.global_state),
        "_DTYPE": default_dtype,
        "_MODES": modes,
    }


def make_checked_call(
    spec: CallSpec,
    call: Callable[..., Any],
    slow: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    bound: Mapping[str, Any],
) -> Callable[..., Any]:
    """``call`` behind one generated comparison; calls that fail it go to ``slow(args, kwargs)``.

    The comparison covers the global state too: grad disabled (a call with grad enabled goes the
    slow way, which decides whether its result would need gradients), autocast, the default dtype
    and the function-mode stack as at the trace."""
    source = (
        "def checked(*args, **kwargs):\n"
        "    try:\n"
        f"        ok = {_check_source(spec)}\n"
        "    except Exception:\n"
        "        ok = False\n"
        "    if ok:\n"
        "        return _call(*args, **kwargs)\n"
        "    return _slow(args, kwargs)\n"
    )
    namespace = {**_check_namespace(spec, bound), "_call": call, "_slow": slow}
    return define(_compiled(source), "<tessera call check>", namespace, "checked")  # our own source


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> CodeType:
    """A check's code, compiled once for an entry's predicate and its checked call: compiling a
    Hugging Face model's (hundreds of values) holds the GIL for ~2 ms, beside the served calls."""
    return compile(source, "<tessera call check>", "exec")


def make_predicate(
    spec: CallSpec, bound: Mapping[str, Any]
) -> Callable[[tuple[Any, ...], dict[str, Any]], bool]:
    """The comparison of make_checked_call alone: ``accepts(args, kwargs)``."""
    checked = make_checked_call(spec, _passed, _failed, bound)
    return lambda args, kwargs: checked(*args, **kwargs)  # type: ignore[no-any-return]


def _passed(*args: Any, **kwargs: Any) -> bool:
    return True


def _failed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return False


def tensor_reader(spec: CallSpec, bound: Mapping[str, Any]) -> Callable[..., tuple[Any, ...]]:
    """A function of ``(args, kwargs)`` returning every tensor the trace read (arguments, nested
    ones, the model's parameters and buffers, globals): what decides whether a result needs grad."""
    exprs = [_key_safe(a.path) for a in spec.assumptions if a.kind is Kind.DTYPE]
    source = (
        "def tensors(args, kwargs):\n"
        "    out = []\n"
        + "".join(f"    try:\n        out.append({e})\n    except Exception:\n        pass\n" for e in exprs)
        + "    return tuple(out)\n"
    )
    return define(source, "<tessera tensors read>", {**bound, "_key": _key}, "tensors")


def explain_state(expected: Sequence[Any], found: Sequence[Any]) -> str:
    """What differs between the global state of the trace and of this call, in words."""
    labels = ("autocast (device, dtype)", "default dtype", "torch function modes (e.g. `with torch.device`)")
    parts = [
        f"{label}: the trace ran with {want!r}, this call with {got!r}"
        for label, want, got in zip(labels, expected, found, strict=False)
        if want != got
    ]
    return "; ".join(parts) or "global state differs"


_ARGUMENT = re.compile(r"^(args)\[(\d+)\]$|^(kwargs)\['([^'\\]*)'\]$")


def layout_path(assumption: Assumption) -> tuple[str, str] | None:
    """``("args", "0")`` / ``("kwargs", "x")`` when ``assumption`` is about the layout of a
    top-level argument (the ones tessera may copy into the traced layout), else None."""
    if assumption.kind is not Kind.LAYOUT:
        return None
    match = _ARGUMENT.match(assumption.path)
    if match is None:
        return None
    groups = [g for g in match.groups() if g is not None]
    return groups[0], groups[1]


def explain(mismatches: Sequence[Mismatch]) -> str:
    """The first broken assumption in words (and how many more there are)."""
    assumption, found = mismatches[0]
    more = f" ({len(mismatches) - 1} more difference(s))" if len(mismatches) > 1 else ""
    expected = short_repr(assumption.expected)
    return f"{assumption.label}: the trace assumed {expected}, this call has {short_repr(found)}{more}"


def advice(mismatches: Sequence[Mismatch]) -> str:
    """What a user can do about a call no trace covers, past the limit of traces."""
    if not mismatches:
        return "pass the arguments as an earlier call did"
    assumption = mismatches[0].assumption
    if assumption.kind is Kind.LAYOUT:
        return "pass a tensor in the traced layout (.contiguous() for most)"
    if assumption.label.startswith(("model.", "function.")):
        return (
            "the model changed after tessera.compile (a parameter's dtype or device, a setting): "
            "compile it again"
        )
    if assumption.kind in (Kind.SIZE, Kind.SHAPE):
        return "mark the dims that vary dynamic (dynamic_dims={...}), or pad inputs to fewer shapes"
    return "convert the input to what an earlier call passed"


def short_repr(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)} on {value.device}"
    if isinstance(value, type):
        return value.__qualname__
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
