"""A piece's inputs as traced, saved with its record so that a process that loaded the piece (and
never traced it) can compile it at a size learnt from its own traffic.

The trace's fake inputs do not outlive the process; what a static compile needs of them does:
each input's dtype, device, and its sizes and strides as expressions of the piece's size symbols
(text: read back with sympy at a learn only, never at a warm start). ``inputs_at`` makes concrete
example inputs from them, as ``piece.specialize_inputs`` does from the fake ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tessera import _compat
from tessera.config import Shape
from tessera.errors import ConfigError

Extent = int | str  # a size or stride: a number, or an expression of the size symbols (text)


@dataclass(frozen=True)
class SavedInput:
    """One input of a piece: a tensor (``shape``/``stride`` as extents), a size (``expr``), or a
    value the trace fixed (``value``: numbers, None, dtypes)."""

    kind: str  # "tensor", "size" or "value"
    shape: tuple[Extent, ...] = ()
    stride: tuple[Extent, ...] = ()
    dtype: torch.dtype | None = None
    device: str = ""
    expr: str = ""
    value: Any = None


@dataclass(frozen=True)
class SavedInputs:
    """Every input of a piece, and its size symbols in ``piece.size_symbols`` order (what a
    Shape's values are given for)."""

    inputs: tuple[SavedInput, ...]
    symbols: tuple[str, ...]


_VALUES = (int, float, bool, str, type(None), torch.dtype)


def saved_inputs(fake_args: Sequence[Any], symbols: Sequence[Any]) -> SavedInputs | None:
    """The fake inputs as saved (``symbols``: ``piece.size_symbols`` of them); None where an input
    is of a kind a static compile could not rebuild (the piece then learns in traced processes
    only)."""
    saved = []
    for value in fake_args:
        if isinstance(value, torch.SymInt):
            saved.append(SavedInput("size", expr=str(_compat.sym_expr(value))))
        elif isinstance(value, torch.Tensor):
            if value.layout != torch.strided or value.is_quantized:
                return None
            saved.append(
                SavedInput(
                    "tensor",
                    shape=tuple(_extent(d) for d in value.shape),
                    stride=tuple(_extent(d) for d in value.stride()),
                    dtype=value.dtype,
                    device=str(value.device),
                )
            )
        elif isinstance(value, _VALUES):
            saved.append(SavedInput("value", value=value))
        else:
            return None
    return SavedInputs(tuple(saved), tuple(str(s) for s in symbols))


def _extent(value: int | torch.SymInt) -> Extent:
    if isinstance(value, torch.SymInt):
        expr = _compat.sym_expr(value)
        return int(expr) if not expr.free_symbols else str(expr)
    return int(value)


def inputs_at(piece: str, saved: SavedInputs, size: int | Shape) -> list[Any]:
    """Concrete example inputs for compiling ``piece`` at one static ``size`` (or ``Shape``):
    tensors of the size's extents (zeros where a size is in them, left empty otherwise: a weight's
    values do not change the code compiled), sizes as numbers, fixed values as they were."""
    import sympy

    if isinstance(size, Shape):
        if len(saved.symbols) != len(size.values):
            raise ConfigError(f"piece {piece}: shape {size} is not one value for each of {saved.symbols}")
        values = dict(zip(saved.symbols, size.values, strict=True))
    elif len(saved.symbols) != 1:
        raise ConfigError(f"piece {piece}: a size needs exactly one dynamic size, found {saved.symbols}")
    else:
        values = {saved.symbols[0]: size}
    by_symbol = {sympy.Symbol(name): value for name, value in values.items()}
    parsed: dict[str, int] = {}

    def concrete(extent: Extent) -> int:
        if isinstance(extent, int):
            return extent
        if extent not in parsed:
            parsed[extent] = int(_compat.sympy_expression(extent).subs(by_symbol))
        return parsed[extent]

    out: list[Any] = []
    for item in saved.inputs:
        if item.kind == "size":
            out.append(concrete(item.expr))
        elif item.kind == "value":
            out.append(item.value)
        else:
            shape = [concrete(d) for d in item.shape]
            stride = [concrete(d) for d in item.stride]
            tensor = torch.empty_strided(shape, stride, dtype=item.dtype, device=item.device)
            out.append(tensor.zero_() if any(isinstance(d, str) for d in item.shape) else tensor)
    return out
