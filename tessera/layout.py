"""Keeping splitting-op outputs in the memory layout the compiled pieces after them expect.

A compiled piece is specialised to its inputs' strides as the op's fake kernel reported them, but
the real kernel may pick another layout at run time (CPU SDPA: math vs flash), so outputs whose
strides differ are copied into the expected layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tessera._compat import sym_expr
from tessera.piece import SizeSource, find_size_source

_MEMO_LIMIT = 4096

# A stride as a polynomial in the size symbol: integer coefficients, highest power first.
Polynomial = tuple[int, ...]


@dataclass(frozen=True)
class OutputLayout:
    """Per output of a splitting piece: its strides as polynomials in one size symbol."""

    strides: tuple[tuple[Polynomial, ...] | None, ...]
    size_source: SizeSource | None

    def expected(self, size: int) -> list[tuple[int, ...] | None]:
        """The strides each output must have when the runtime size is ``size``."""
        return [None if s is None else tuple(_evaluate(p, size) for p in s) for s in self.strides]


def _evaluate(poly: Polynomial, x: int) -> int:
    value = 0
    for coefficient in poly:
        value = value * x + coefficient
    return value


def output_layout(graph: torch.fx.GraphModule) -> OutputLayout | None:
    """The strides a splitting piece's outputs were traced with; None if nothing needs keeping."""
    import sympy  # the trace path only: a warm start reads the polynomials

    output = next(iter(reversed(graph.graph.nodes)))
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    values = [n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None for n in returned]
    exprs: list[list[Any] | None] = []
    symbols: set[Any] = set()
    for value in values:
        if not isinstance(value, torch.Tensor):
            exprs.append(None)
            continue
        row = [sym_expr(s) if isinstance(s, torch.SymInt) else sympy.Integer(s) for s in value.stride()]
        for expr in row:
            symbols |= expr.free_symbols
        exprs.append(row)
    if not any(e is not None for e in exprs) or len(symbols) > 1:
        return None
    symbol = next(iter(symbols)) if symbols else sympy.Symbol("s")
    strides: list[tuple[Polynomial, ...] | None] = []
    for maybe_row in exprs:
        if maybe_row is None:
            strides.append(None)
            continue
        polys = []
        for expr in maybe_row:
            try:
                coefficients = sympy.Poly(expr, symbol).all_coeffs()
            except sympy.PolynomialError:
                return None  # not a polynomial in the size (a floor division): cannot keep it
            if not all(c.is_Integer for c in coefficients):
                return None
            polys.append(tuple(int(c) for c in coefficients))
        strides.append(tuple(polys))
    inputs = [n.meta.get("example_value") for n in graph.graph.nodes if n.op == "placeholder"]
    # The size the strides are polynomials in: read where that very symbol is (with batch and
    # sequence both dynamic, the first dynamic dim is the batch, not what the strides use).
    source = find_size_source(inputs, symbol) if symbols else None
    if symbols and source is None:
        return None
    return OutputLayout(tuple(strides), source)


class LayoutKeeper:
    """Runs a splitting piece, then copies any output whose strides differ from the traced ones."""

    def __init__(self, fn: Callable[..., Any], layout: OutputLayout) -> None:
        self.fn = fn
        self.layout = layout
        self._memo: dict[int, list[tuple[int, ...] | None]] = {}

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        source = self.layout.size_source
        size = 0 if source is None else source.read(args)
        expected = self._memo.get(size)
        if expected is None:
            expected = self.layout.expected(size)
            if len(self._memo) < _MEMO_LIMIT:
                self._memo[size] = expected
        if isinstance(out, torch.Tensor):
            return _relayout(out, expected[0])
        return type(out)(_relayout(o, e) for o, e in zip(out, expected, strict=True))


def _relayout(value: Any, stride: Sequence[int] | None) -> Any:
    if stride is None or not isinstance(value, torch.Tensor) or value.stride() == tuple(stride):
        return value
    # Strides of size-1 dims are meaningless; only a real difference costs a copy.
    if all(a == b or n <= 1 for a, b, n in zip(value.stride(), stride, value.shape, strict=True)):
        return value
    return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)
