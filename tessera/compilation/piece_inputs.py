"""A piece's inputs as traced, saved with its record so that a process that loaded the piece (and
never traced it) can compile it at a size learnt from its own traffic.

The trace's fake inputs do not outlive the process; what a static compile needs of them does:
each input's dtype, device, and its sizes and strides as expressions of the piece's size symbols
(text: read back with sympy at a learn only, never at a warm start). ``inputs_at`` makes concrete
example inputs from them, as ``piece.specialize_inputs`` does from the fake ones.
"""

from __future__ import annotations

import os
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
            if not _compat.is_plain_tensor(value) or value.layout != torch.strided or value.is_quantized:
                return None  # a subclass would be compiled for as a plain tensor
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


def fixed(saved: SavedInputs) -> tuple[bool, ...]:
    """Per input: a tensor of no size symbol (a weight, a static cache): what a call's own tensor
    can stand in for at a compile (``inputs_at``'s ``real``)."""
    return tuple(
        item.kind == "tensor" and not any(isinstance(d, str) for d in (*item.shape, *item.stride))
        for item in saved.inputs
    )


def inputs_at(
    piece: str, saved: SavedInputs, size: int | Shape, real: Sequence[torch.Tensor | None] = ()
) -> list[Any]:
    """Concrete example inputs for compiling ``piece`` at one static ``size`` (or ``Shape``):
    ``real``'s tensor where a call's fixed input is still alive (its weights: no copy), else a
    zero tensor of the size's extents; sizes as numbers, fixed values as they were. A
    ``ConfigError`` where the tensors made would not fit in their device's memory."""
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
    made: list[tuple[int, list[int], list[int]]] = []  # (input, shape, stride) of each tensor to make
    needed: dict[str, int] = {}
    for index, item in enumerate(saved.inputs):
        alive = _alive(item, real, index) if item.kind == "tensor" else None
        if item.kind == "size":
            out.append(concrete(item.expr))
        elif item.kind == "value" or alive is not None:
            out.append(item.value if alive is None else alive)
        else:
            shape, stride = [concrete(d) for d in item.shape], [concrete(d) for d in item.stride]
            assert item.dtype is not None, "a saved tensor has its dtype"
            extent = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True))
            needed[item.device] = needed.get(item.device, 0) + extent * item.dtype.itemsize
            made.append((index, shape, stride))
            out.append(None)
    for device, nbytes in needed.items():
        available = device_memory(torch.device(device))
        if available is not None and nbytes > available:
            raise ConfigError(
                f"piece {piece}: {size} needs {nbytes / 2**30:.1f} GiB of example inputs on {device}, "
                f"which has {available / 2**30:.1f} GiB"
            )
    for index, shape, stride in made:  # only once they are known to fit
        item = saved.inputs[index]
        out[index] = torch.empty_strided(shape, stride, dtype=item.dtype, device=item.device).zero_()
    return out


def _alive(item: SavedInput, real: Sequence[torch.Tensor | None], index: int) -> torch.Tensor | None:
    """A call's own tensor for a fixed input, where it still is what was traced."""
    tensor = real[index] if index < len(real) else None
    if (
        tensor is None
        or tuple(tensor.shape) != item.shape
        or tuple(tensor.stride()) != item.stride
        or tensor.dtype != item.dtype
        or str(tensor.device) != item.device
    ):
        return None
    return tensor


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory on ``device`` (None if unknown)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[1])
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None
