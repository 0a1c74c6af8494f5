"""Keeping splitting-op outputs in the memory layout the compiled pieces after them expect.

A compiled piece is specialised to its inputs' strides as the op's fake kernel reported them, but
the real kernel may pick another layout at run time (CPU SDPA: math vs flash), so outputs whose
strides differ are copied into the expected layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx

from tessera.piece import SizeSource, find_size_source

_MEMO_LIMIT = 4096


@dataclass(frozen=True)
class OutputLayout:
    """Per output of a splitting piece: its strides as expressions in one size symbol."""

    strides: tuple[tuple[str, ...] | None, ...]
    symbol: str | None
    size_source: SizeSource | None


def output_layout(graph: torch.fx.GraphModule) -> OutputLayout | None:
    """The strides a splitting piece's outputs were traced with; None if nothing needs keeping."""
    output = next(iter(reversed(graph.graph.nodes)))
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    values = [n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None for n in returned]
    symbols: set[sympy.Symbol] = set()
    strides: list[tuple[str, ...] | None] = []
    for value in values:
        if not isinstance(value, torch.Tensor):
            strides.append(None)
            continue
        exprs = []
        for stride in value.stride():
            expr = stride.node.expr if isinstance(stride, torch.SymInt) else sympy.Integer(stride)
            symbols |= expr.free_symbols
            exprs.append(str(expr))
        strides.append(tuple(exprs))
    if not any(s is not None for s in strides) or len(symbols) > 1:
        return None
    inputs = [n.meta.get("example_value") for n in graph.graph.nodes if n.op == "placeholder"]
    source = find_size_source(inputs) if symbols else None
    if symbols and source is None:
        return None
    return OutputLayout(tuple(strides), str(next(iter(symbols))) if symbols else None, source)


class LayoutKeeper:
    """Runs a splitting piece, then copies any output whose strides differ from the traced ones."""

    def __init__(self, fn: Callable[..., Any], layout: OutputLayout) -> None:
        self.fn = fn
        self.layout = layout
        self._symbol = sympy.Symbol(layout.symbol) if layout.symbol else None
        self._exprs = [None if s is None else [sympy.sympify(e) for e in s] for s in layout.strides]
        self._memo: dict[int, list[tuple[int, ...] | None]] = {}

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        source = self.layout.size_source
        size = 0 if source is None else source.read(args)
        expected = self._memo.get(size)
        if expected is None:
            expected = self._expected(size)
        if isinstance(out, torch.Tensor):
            return _relayout(out, expected[0])
        return type(out)(_relayout(o, e) for o, e in zip(out, expected, strict=True))

    def _expected(self, size: int) -> list[tuple[int, ...] | None]:
        subs = {self._symbol: size} if self._symbol is not None else {}
        expected = [None if e is None else tuple(int(x.subs(subs)) for x in e) for e in self._exprs]
        if len(self._memo) < _MEMO_LIMIT:
            self._memo[size] = expected
        return expected


def _relayout(value: Any, stride: Sequence[int] | None) -> Any:
    if stride is None or not isinstance(value, torch.Tensor) or value.stride() == tuple(stride):
        return value
    # Strides of size-1 dims are meaningless; only a real difference costs a copy.
    if all(a == b or n <= 1 for a, b, n in zip(value.stride(), stride, value.shape, strict=True)):
        return value
    return torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)
