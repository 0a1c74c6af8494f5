"""A general compile's example inputs, made to cross a process boundary.

A piece's general artifact is compiled for the trace's symbolic sizes: its example inputs are fake
tensors whose sizes are expressions over the trace's size symbols (``s0``, ``2*s0``, ``s0*s1``),
bound to the trace's shape env, which does not pickle. ``describe`` reads out what a compile needs
of them (each symbol's hint and range, each tensor's sizes and strides as expressions); ``rebuild``
makes the same inputs again in a compile worker, in a shape env of its own, so that the compile
there gives code for every size the trace's covers.

What is not carried, and why it is safe: facts the trace's shape env learnt beyond each symbol's
range (equalities and guards from the whole model's trace). Without them the worker's code is at
least as general as the code a compile here would give. What cannot be carried is refused (None),
and the piece compiles in this process: an unbacked size, a symbol that is not a size's (positive),
inputs that share storage (the compile plans for the aliasing it sees), a view at an offset, a
tensor that is not a plain strided one or carries conjugate or negative view bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tessera import _compat


@dataclass(frozen=True)
class SymbolSpec:
    """One size symbol of the trace: its name there, the size the trace saw, its range."""

    name: str
    hint: int
    lower: int | None  # None: unbounded
    upper: int | None


@dataclass(frozen=True)
class SymbolicTensor:
    """A fake tensor's layout, each size and stride an int or an expression (sympy) over the
    trace's symbols."""

    shape: tuple[Any, ...]
    stride: tuple[Any, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool


@dataclass(frozen=True)
class SymbolicInt:
    """A SymInt input (a size the graph takes as an argument)."""

    expr: Any


@dataclass(frozen=True)
class SymbolicInputs:
    """A general compile's example inputs: the symbols, then each input (a ``SymbolicTensor``,
    a ``SymbolicInt``, or a plain value as is)."""

    symbols: tuple[SymbolSpec, ...]
    values: tuple[Any, ...]


class _Refused(Exception):
    """An input that cannot be described for another process."""


def describe(example_inputs: Sequence[Any]) -> SymbolicInputs | None:
    """What ``rebuild`` needs to make ``example_inputs`` again elsewhere; None when some input
    cannot cross (see the module's docstring)."""
    symbols: dict[str, SymbolSpec] = {}
    try:
        values = tuple(_describe_one(value, symbols) for value in example_inputs)
    except _Refused:
        return None
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    for i, a in enumerate(tensors):
        if any(_compat.same_storage(a, b) for b in tensors[i + 1 :]):
            return None
    return SymbolicInputs(tuple(symbols.values()), values)


def _describe_one(value: Any, symbols: dict[str, SymbolSpec]) -> Any:
    if isinstance(value, torch.Tensor):
        if not _compat.is_plain_tensor(value) or value.layout != torch.strided:
            raise _Refused
        if value.is_conj() or value.is_neg():  # view bits an empty_strided tensor does not have
            raise _Refused
        if _as_int(value.storage_offset(), symbols) != 0:
            raise _Refused  # a view into a larger storage: the compile would see a base it has not
        return SymbolicTensor(
            tuple(_as_int(d, symbols) for d in value.shape),
            tuple(_as_int(d, symbols) for d in value.stride()),
            value.dtype,
            str(value.device),
            value.requires_grad,
        )
    if isinstance(value, torch.SymInt):
        expr = _as_int(value, symbols)
        return SymbolicInt(expr) if not isinstance(expr, int) else expr
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        raise _Refused
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    raise _Refused


def _as_int(value: Any, symbols: dict[str, SymbolSpec]) -> Any:
    """An int as is; a SymInt as its expression, its symbols added to ``symbols``."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    if _compat.is_constant_symint(value):
        return int(value)
    facts = _compat.symbol_facts(value)
    if facts is None:
        raise _Refused
    for symbol, (hint, lower, upper) in facts.items():
        if not symbol.is_positive:
            # An int argument's symbol (Dynamo makes sizes positive): one made again here would be
            # positive, and sympy would then fold its expressions (Eq(s, 0) to False) as the
            # trace did not.
            raise _Refused
        symbols.setdefault(str(symbol), SymbolSpec(str(symbol), hint, lower, upper))
    return _compat.sym_expr(value)


def rebuild(spec: SymbolicInputs, graph: torch.fx.GraphModule) -> list[Any]:
    """The example inputs ``spec`` describes, as fake tensors in a shape env of this process, and
    ``graph``'s nodes given their fake values (what a general compile reads its sizes from).
    Raises ValueError when a symbol cannot be made again with its hint and range (the worker then
    fails the job, and the parent compiles the piece itself)."""
    maker = _compat.SymbolMaker()
    made: dict[Any, Any] = {}
    hints: dict[Any, int] = {}
    for symbol in spec.symbols:
        new = maker.symbol(symbol.name, symbol.hint, symbol.lower, symbol.upper)
        if new is None:
            raise ValueError(
                f"size symbol {symbol.name} (hint {symbol.hint}, range [{symbol.lower}, "
                f"{symbol.upper}]) cannot be made again with that range"
            )
        made[symbol.name] = new
        hints[new] = symbol.hint

    def size(value: Any) -> Any:
        if isinstance(value, int):
            return value
        expr = value.xreplace({old: made[str(old)] for old in value.free_symbols})
        return maker.symint(expr, int(expr.xreplace(hints)))

    inputs: list[Any] = []
    with maker.mode:
        for value in spec.values:
            if isinstance(value, SymbolicTensor):
                tensor = torch.empty_strided(
                    [size(d) for d in value.shape],
                    [size(d) for d in value.stride],
                    dtype=value.dtype,
                    device=value.device,
                )
                inputs.append(tensor.requires_grad_(value.requires_grad))
            elif isinstance(value, SymbolicInt):
                inputs.append(size(value.expr))
            else:
                inputs.append(value)
    maker.propagate(graph, inputs)
    return inputs
