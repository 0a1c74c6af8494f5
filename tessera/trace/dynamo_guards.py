"""Dynamo's guards, turned into the call check's assumptions before the first call runs.

Every guard Dynamo produced for the one trace is either kept, as an expression the per-call check
compares (call_check.py), or dropped on purpose for the reason in ``DROPPED``. A guard on the call's
arguments of a kind tessera does not know refuses the compile, naming it: never a silent drop.
"""

from __future__ import annotations

import ast
import collections
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera._compat import GuardFact, local_source_name
from tessera.compilation.layout import layout_of
from tessera.errors import UnsupportedModelError
from tessera.trace.assumption import Assumption, Kind
from tessera.trace.call_check import local_expression

log = logging.getLogger(__name__)

# Why each dropped kind of guard is not re-checked per call. Keys are (kind, root); root "*" is
# any root. Roots: "input" (the call's arguments), "model" (the model and what it holds, reached
# through ``target``), "global" (module globals), "state" (torch's global state).
DROPPED: dict[tuple[str, str], str] = {
    # Global state: checked by tessera's own state record (call_check.CallState), or irrelevant to an
    # inference graph.
    ("GRAD_MODE", "state"): "grad mode: tessera compiles inference graphs (see api.py, grad policy)",
    ("GLOBAL_STATE", "state"): "autocast and the default dtype are in tessera's call state check",
    ("TORCH_FUNCTION_STATE", "state"): "function modes are in tessera's call state check",
    ("DEFAULT_DEVICE", "state"): "the default device is a function mode: in tessera's call state check",
    ("DETERMINISTIC_ALGORITHMS", "state"): "picks kernels, not results",
    ("AUTOGRAD_SAVED_TENSORS_HOOKS", "state"): "inference graphs save no tensors for backward",
    ("FUNCTORCH_STACK_MATCH", "state"): "functorch transforms are not traced through tessera",
    ("DUAL_LEVEL", "state"): "forward-mode AD is not traced through tessera",
    # The model's structure: fixed once compiled (a changed structure needs a new tessera.compile;
    # checking it would cost a lookup per submodule per call). Its parameters, buffers and plain
    # values (config numbers, flags, closures) are kept.
    ("TYPE_MATCH", "model"): "the type of a submodule or of its parameter dicts: structure",
    ("ID_MATCH", "model"): "the identity of a submodule or class: structure",
    ("CLASS_MATCH", "model"): "a submodule's class: structure",
    ("MODULE_MATCH", "model"): "a Python module reached from the model: code",
    ("NN_MODULE", "model"): "a submodule's identity: structure",
    ("HASATTR", "model"): "attribute presence on the model: structure",
    ("NOT_PRESENT_IN_GENERIC_DICT", "model"): "attribute shadowing on a submodule: structure",
    ("DICT_NOT_CONTAINS", "*"): "class dictionaries: the type is checked and its source is in the cache key",
    ("DICT_CONTAINS", "model"): "dict membership inside the model: structure",
    ("DICT_KEYS_MATCH", "model"): "the keys of the model's submodule and parameter dicts: structure",
    ("EMPTY_NN_MODULE_HOOKS_DICT", "model"): (
        "submodule hooks: registering one after compiling needs a new tessera.compile (the root's "
        "hooks run as in eager)"
    ),
    ("CLOSURE_MATCH", "*"): "the code of a function: its source file is in the cache key",
    ("FUNCTION_MATCH", "model"): "a method of the model: code, in the cache key",
    ("DUPLICATE_INPUT", "model"): "two names for one object of the model: structure",
    ("DUPLICATE_INPUT", "global"): "two names for one global: imports",
    ("SEQUENCE_LENGTH", "global"): "the length of a global registry: imports",
    ("NO_TENSOR_ALIASING", "*"): (
        "distinct tensors assumed distinct: differs only for a model that writes to one input and "
        "reads another that aliases it"
    ),
    ("NOT_PRESENT_IN_GENERIC_DICT", "input"): "attribute shadowing on a module passed as an argument",
    ("WEAKREF_ALIVE", "*"): "tessera holds what it checks",
    ("OBJECT_MUTATION", "*"): "tracked by the values it guards, which are kept",
}
# Globals: module-level functions, classes, modules and registries are the program's code, whose
# source files are in the cache key; they do not change between calls of one process. Their plain
# values (a module-level float) and tensors are kept.
_GLOBAL_VALUE_KINDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH", "TENSOR_MATCH"})
# A module-level value reached by plain steps, attributes and constant indexes or keys
# (``G['__import_m'].SCALE``, ``.CFG['k']``, a function's ``__defaults__[0]``, a nested function's
# ``__closure__[0].cell_contents``): kept, as a script may set it otherwise in its next process
# (from the environment) with the same source. Registries read through calls are not.
_PLAIN_GLOBAL = re.compile(r"^G\['[^']+'\]\.\w+(\.\w+|\[\d+\]|\['[\w.-]*'\])*$")
_GLOBAL_REASON = "module-level code, classes, modules and registries: imports, in the cache key"
# Expressions through a class's internals (``dict(type(x).__mro__[1].__dict__)``): the type itself
# is checked; reading them per call would copy a dict each time.
_CLASS_INTERNALS = re.compile(r"^(dict\(type\(|type\()|\.__mro__|\.__dict__\)")
_CLASS_REASON = "class internals: the argument's type is checked and its source is in the cache key"
# Values tessera itself sets while it traces (wrapper/_compat.single_trace_settings): the graph is
# made for them, whatever the caller's setting.
_OWN_SETTINGS = re.compile(r"torch\.backends\.mha\._is_fastpath_enabled$")
_OWN_REASON = (
    "a setting tessera fixes while tracing (the MHA fast path is off: the graph takes the plain path)"
)
_STATE_KINDS = frozenset(k for k, root in DROPPED if root == "state")
_IDENTITY_KINDS = frozenset({"ID_MATCH", "CLASS_MATCH", "BUILTIN_MATCH", "FUNCTION_MATCH", "MODULE_MATCH"})
_VALUE_KINDS = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})
_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
# Dynamo's 0/1 specialisation: a dynamic size is traced as ``>= 2`` (``2 <= s0``), and code that
# behaves differently at 1 (``x.squeeze()``, ``if q_len > 1``) is traced for the larger sizes only.
# The floor is checked; a call under it is served by a trace for its own small size (api.py).
# Dynamo's floor on a dynamic dim, in its own words: the one place its text is read for a path.
_SIZE_FLOOR = re.compile(r"^2 <= (?P<path>[\w\[\]'.()]+)\.size\(\)\[(?P<dim>\d+)\]$")


@dataclass(frozen=True)
class Translation:
    """Dynamo's guards as assumptions, with the objects their expressions read through."""

    assumptions: tuple[Assumption, ...]
    parents: tuple[str, ...]  # ``_o{i}`` binds to the i-th expression (over ``target`` and ``G``)
    dropped: tuple[tuple[str, int], ...]  # (reason, how many guards) dropped on purpose


def fact_name_is_root(name: str) -> bool:
    """``target`` itself, its ``__self__`` or ``__func__``: the compiled callable, ours to hold."""
    return name in ("target", "target.__self__", "target.__func__")


def root_of(name: str) -> str:
    """Which root a guard source starts from: input, model, global or state."""
    if not name:
        return "state"
    names = {n.id for n in ast.walk(_parse(name)) if isinstance(n, ast.Name)}
    if names & {"args", "kwargs"}:
        return "input"
    if "target" in names:
        return "model"
    return "global"


def _parse(expr: str) -> ast.AST:
    try:
        return ast.parse(expr, mode="eval")
    except SyntaxError:
        return ast.parse("None", mode="eval")


class _Builder:
    def __init__(self, symbolic: Mapping[str, tuple[bool, ...]], label: Callable[[str], str]) -> None:
        self.symbolic = symbolic
        self.label = label
        self.assumptions: list[Assumption] = []
        self.parents: list[str] = []
        self.dropped: collections.Counter[str] = collections.Counter()
        self.current = ""  # the source of the guard being translated

    def bound(self, name: str, root: str) -> str:
        """``name`` with the object it reads through bound once (model and global roots): the
        check then pays one lookup, not the whole attribute chain."""
        if root == "input":
            return name
        tree = _parse(name)
        body = getattr(tree, "body", None)
        if isinstance(body, ast.Attribute):
            parent, tail = ast.unparse(body.value), f".{body.attr}"
        elif isinstance(body, ast.Subscript) and isinstance(body.slice, ast.Constant):
            parent, tail = ast.unparse(body.value), f"[{body.slice.value!r}]"
        else:
            return name
        if parent in ("target", "G"):
            return name
        if parent not in self.parents:
            self.parents.append(parent)
        return f"_o{self.parents.index(parent)}{tail}"

    def add(
        self,
        expr: str,
        expected: Any,
        label: str,
        kind: Kind = Kind.OTHER,
        path: str = "",
        dim: int | None = None,
    ) -> None:
        self.assumptions.append(Assumption(expr, expected, label, kind, path, dim))

    def tensor(self, expr: str, name: str, value: torch.Tensor, root: str, label: str) -> None:
        self.add(f"type({expr})", type(value), f"{label}: type", Kind.TYPE, expr)
        self.add(f"{expr}.dtype", value.dtype, f"{label}: dtype", Kind.DTYPE, expr)
        self.add(f"{expr}.device", value.device, f"{label}: device", Kind.DEVICE, expr)
        symbolic = self.symbolic.get(name, (False,) * value.dim())
        if root != "input" or not any(symbolic):
            self.add(f"{expr}.shape", value.shape, f"{label}: shape", Kind.SHAPE, expr)
        else:
            self.add(f"{expr}.dim()", value.dim(), f"{label}: number of dims", Kind.RANK, expr)
            for d, size in enumerate(value.shape):
                if not symbolic[d]:
                    self.add(
                        f"{expr}.shape[{d}]",
                        int(size),
                        f"{label}: size of dim {d} (static)",
                        Kind.SIZE,
                        expr,
                        d,
                    )
        if root != "input":
            return  # a parameter or buffer: its layout is the model's own, fixed once compiled
        if value.is_contiguous():
            self.add(f"{expr}.is_contiguous()", True, f"{label}: layout (contiguous)", Kind.LAYOUT, expr)
        elif not any(symbolic):
            self.add(f"{expr}.stride()", value.stride(), f"{label}: layout (strides)", Kind.LAYOUT, expr)
        else:
            self.add(
                f"_layout({expr})", layout_of(value), f"{label}: layout (stride order)", Kind.LAYOUT, expr
            )

    def value(self, expr: str, value: Any, label: str, state: bool) -> None:
        self.add(f"type({expr})", type(value), f"{label}: type", Kind.TYPE, expr)
        self.add(expr, value, f"{label}: value", Kind.STATE if state else Kind.VALUE, expr)

    def fact(self, fact: GuardFact) -> None:
        root = root_of(fact.name)
        kind = fact.kind
        if kind == "SHAPE_ENV":  # no source of its own: each guard names the sizes it reads
            self.shape_guards(fact.code)
            return
        if root == "state" or kind in _STATE_KINDS:
            self._drop(kind, "state")
            return
        if _OWN_SETTINGS.search(self.label(fact.name)):
            self.dropped[_OWN_REASON] += 1
            return
        if _CLASS_INTERNALS.search(fact.name):
            self.dropped[_CLASS_REASON] += 1
            return
        if root == "global" and (kind not in _GLOBAL_VALUE_KINDS or not _PLAIN_GLOBAL.match(fact.name)):
            self.dropped[_GLOBAL_REASON] += 1
            return
        self.current = fact.name
        label = self.label(fact.name)
        expr = self.bound(fact.name, root)
        value = fact.value
        if kind == "TENSOR_MATCH" and isinstance(value, torch.Tensor):
            self.tensor(expr, fact.name, value, root, label)
        elif kind in _VALUE_KINDS and fact.has_value:
            # An int read from an argument object (a StaticCache's length) is state: it may be
            # traced as a symbol once it changes (api.py).
            state = root == "input" and not re.match(r"^(args\[\d+\]|kwargs\['[^']*'\])$", fact.name)
            self.value(expr, value, label, state)
        elif kind in _IDENTITY_KINDS and fact.has_value and not self._structure(kind, root, value):
            self.add(expr, value, f"{label}: identity")
        elif kind == "TYPE_MATCH" and fact.has_value and not self._structure(kind, root, value):
            self.add(f"type({expr})", type(value), f"{label}: type", Kind.TYPE, expr)
        elif kind == "SEQUENCE_LENGTH" and fact.has_value and root != "global":
            self.add(f"type({expr})", type(value), f"{label}: type", Kind.TYPE, expr)
            self.add(f"len({expr})", len(value), f"{label}: length", Kind.OTHER, expr)
        elif kind in ("DICT_KEYS_MATCH", "DICT_KEYS") and fact.has_value and root == "input":
            self.add(f"list({expr}.keys())", list(value.keys()), f"{label}: keys")
        elif kind == "CLOSURE_MATCH" and fact.has_value and getattr(value, "__closure__", None):
            self.closure(fact.name, value, label)
        elif kind == "HASATTR" and fact.has_value and "attr" in dict(fact.detail):
            attr = dict(fact.detail)["attr"]
            self.add(f"hasattr({expr}, {attr!r})", hasattr(value, attr), f"{label}: has .{attr}")
        elif (
            kind == "NOT_PRESENT_IN_GENERIC_DICT"
            and fact.has_value
            and "attr" in dict(fact.detail)
            and not isinstance(value, torch.nn.Module)
        ):
            # A plain object's attribute read from its class (a config's default): setting it on the
            # instance later would shadow what the graph baked in.
            attr = dict(fact.detail)["attr"]
            self.add(
                f"{attr!r} in vars({expr})", attr in vars(value), f"{label}: .{attr} set on the instance"
            )
        elif kind == "DUPLICATE_INPUT" and "source_b" in dict(fact.detail):
            # Two sources Dynamo saw as one object (a ModelOutput's ``.last_hidden_state`` and its
            # ``[0]``): the graph reads it once, so they must stay one object.
            other = local_source_name(dict(fact.detail)["source_b"])
            other_expr = self.bound(other, root_of(other))
            self.add(f"{expr} is {other_expr}", True, f"{label}: the same object as {self.label(other)}")
        elif kind == "NOT_NONE_MATCH":
            self.add(f"{expr} is not None", True, f"{label}: not None")
        elif (kind, root) in DROPPED or (kind, "*") in DROPPED:
            self._drop(kind, root)
        elif root == "input" and self.generic(fact):
            pass
        elif root == "input":
            raise UnsupportedModelError(
                f"Dynamo guards {fact.name} with a {kind} guard, which tessera's call check does not "
                "know how to re-check; dropping it could serve a changed argument wrongly. Use "
                "mode='stock' (Dynamo keeps its guards) or pass that value in another form"
            )
        else:
            self._drop(kind, root)

    def closure(self, name: str, function: Any, label: str) -> None:
        """A function's closure cells: their plain values are what the graph baked in (its code is
        dropped: the source file is in the cache key)."""
        self._drop("CLOSURE_MATCH", "*")
        for i, cell in enumerate(function.__closure__):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if not isinstance(contents, _SCALARS):
                # Functions a decorator wraps, modules, tensors: code (in the cache key) or guarded
                # on their own.
                continue
            expr = self.bound(f"{name}.__closure__[{i}].cell_contents", root_of(name))
            self.value(expr, contents, f"{label} closure[{i}]", state=False)

    def _structure(self, kind: str, root: str, value: Any) -> bool:
        """A model-rooted guard on its structure (submodules, their dicts, classes): dropped."""
        if root != "model":
            return False
        structural = (
            fact_name_is_root(self.current)
            or isinstance(value, (torch.nn.Module, dict, type, type(torch)))
            or kind
            in (
                "CLASS_MATCH",
                "MODULE_MATCH",
            )
        )
        if structural:
            self._drop(kind, root)
        return structural

    def _drop(self, kind: str, root: str) -> None:
        reason = DROPPED.get((kind, root)) or DROPPED.get((kind, "*")) or f"{kind} on the {root}"
        self.dropped[reason] += 1

    def generic(self, fact: GuardFact) -> bool:
        """A guard of another kind, kept through Dynamo's own Python form when it has a portable one."""
        exprs = [local_expression(code) for code in fact.code]
        if not exprs or any(e is None or "___" in e for e in exprs):
            return False
        for expr in exprs:
            assert expr is not None, "filtered above"
            self.add(expr, True, f"{self.label(fact.name)}: {fact.kind} {expr}")
        return True

    def relations(self, symbols: Mapping[str, tuple[str | None, ...]]) -> None:
        """Dims Dynamo gave one symbol (``x + y`` traced with equal sizes) must stay equal: the
        compiled kernels index both with one size. Only argument-rooted inputs are related."""
        first: dict[str, str] = {}
        for name, dims in symbols.items():
            if root_of(name) != "input":
                continue
            for d, symbol in enumerate(dims):
                if symbol is None:
                    continue
                here = f"{name}.shape[{d}]"
                if symbol in first:
                    expr = f"{here} == {first[symbol]}"
                    self.add(
                        expr, True, f"sizes: {self.label(name)} dim {d} equals {first[symbol]}", Kind.STATE
                    )
                else:
                    first[symbol] = here

    def shape_guards(self, code: tuple[str, ...]) -> None:
        for guard in code:
            expr = local_expression(guard)
            if expr is None or "._base" in expr:
                # A guard on a view's base: what the view came from, not what the graph computes.
                self.dropped["shape guards on a view's base or outside the arguments"] += 1
                continue
            floor = _SIZE_FLOOR.match(expr)
            if floor is not None:
                self.add(expr, True, f"sizes: {expr}", Kind.FLOOR, floor["path"], int(floor["dim"]))
                continue
            self.add(expr, True, f"sizes: {expr}", Kind.STATE)


def translate(
    facts: list[GuardFact],
    symbolic: Mapping[str, tuple[bool, ...]],
    label: Callable[[str], str],
    relations: Mapping[str, tuple[str | None, ...]] | None = None,
) -> Translation:
    """Dynamo's guards of the one trace as assumptions (read now, before the first call runs).

    ``symbolic`` gives, per graph input, the dims Dynamo kept symbolic; ``label(name)`` names a
    source for messages. Raises UnsupportedModelError for a guard on the arguments of a kind
    tessera cannot re-check.
    """
    builder = _Builder(symbolic, label)
    for fact in facts:
        builder.fact(fact)
    builder.relations(relations or {})
    return Translation(tuple(builder.assumptions), tuple(builder.parents), tuple(builder.dropped.items()))


def readable(name: str, names: Mapping[str, str]) -> str:
    """A guard source as a user knows it: ``input_ids``, ``model.layers.0.weight``, ``scale``."""
    root = re.match(r"^(args\[\d+\]|kwargs\['[^']*'\])", name)
    if root is not None:
        return names.get(root.group(1), root.group(1)) + name[root.end() :]
    text = name.replace("target.__self__", "model").replace("target.__func__", "function")
    text = re.sub(r"\._(?:modules|parameters|buffers)\['([^']*)'\]", r".\1", text)
    # G only as a name of its own: ``CFG['k']`` is no global of the frame.
    text = re.sub(r"\bG\['__import_([\w]+)'\]", lambda m: m.group(1).replace("_dot_", "."), text)
    return re.sub(r"\bG\['([^']*)'\]", r"\1", text)
