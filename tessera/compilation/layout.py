"""Keeping tensors in the memory layout they were traced with, which is eager's.

Two places where the layout may drift: a splitting op's real kernel may pick another layout than
its fake kernel reported (CPU SDPA: math vs flash), so its outputs whose strides differ are copied
into the expected layout (LayoutKeeper); and Inductor may lay out a compiled piece's output its own
way, so the graph it compiles says eager's layout (keep_eager_layouts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tessera._compat import is_view, size_hint, sym_expr
from tessera.compilation.piece import SizeSource, find_size_source

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


def output_order(value: Any) -> tuple[int, ...] | None:
    """The dim order (outermost stride first) of a dense tensor that views no other: the layout
    it was traced with, eager's. None where the order alone does not say its strides."""
    if not isinstance(value, torch.Tensor) or is_view(value):
        return None
    shape = [size_hint(n) for n in value.shape]
    strides = [size_hint(n) for n in value.stride()]
    order = tuple(sorted(range(len(shape)), key=lambda d: (-strides[d], d)))
    expected = 1
    for dim in reversed(order):
        if shape[dim] != 1:  # a size-1 dim's stride means nothing
            if strides[dim] != expected:
                return None
            expected *= shape[dim]
    return order


def keep_eager_layouts(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a piece's graph that lays out each output (or the tensor an output views) the
    way it was traced, which is eager's layout, for Inductor to compile.

    Inductor is free to lay out an intermediate its own way and keeps an output's strides only as
    its own decompositions report them, which may differ from eager's: ``cat`` with an empty
    tensor (a Hugging Face cache's first update) becomes a clone of the other input, in that
    input's layout, where eager returns a contiguous tensor. A model's state (a KV cache) would then
    be laid out one way while the piece serves as traced and another once it serves compiled, and a
    trace made in one process would not fit the next's calls. Saying the layout in the graph
    (``permute(order).contiguous().permute(back)``, a no-op where the layouts already agree) makes
    Inductor write it. The graph given is left as it is (it serves as traced and in dumps).
    """
    graph = gm.graph
    output = next(iter(reversed(graph.nodes)))
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    bases: dict[torch.fx.Node, tuple[int, ...]] = {}
    for node in returned:
        base = _viewed_node(node) if isinstance(node, torch.fx.Node) else None
        if base is None or base.op == "placeholder":  # an input's layout is the caller's
            continue
        order = output_order(base.meta.get("example_value"))
        if order is not None:
            bases[base] = order
    if not bases:
        return gm
    copied = torch.fx.Graph()
    values: dict[torch.fx.Node, torch.fx.Node] = {}
    copied_output = copied.graph_copy(graph, values)
    copied.output(copied_output)
    for base, order in bases.items():
        node = values[base]
        back = tuple(sorted(range(len(order)), key=order.__getitem__))
        identity = order == tuple(range(len(order)))
        with copied.inserting_after(node):
            first = node if identity else copied.call_method("permute", (node, order))
        with copied.inserting_after(first):
            laid = copied.call_method("contiguous", (first,))
        last = laid
        if not identity:
            with copied.inserting_after(laid):
                last = copied.call_method("permute", (laid, back))
        # Inductor finds the trace's fake mode on the outputs' example values, and the layout
        # written is the one traced: the base's own example value stands for the last node.
        # (The base is laid out in ``order``, so its permutation is already contiguous.)
        value = node.meta["example_value"]
        permuted = value if identity else value.permute(order)
        if first is not node:
            first.meta["example_value"] = permuted
        laid.meta["example_value"] = permuted
        last.meta["example_value"] = value
        made = frozenset({first, laid, last} - {node})
        node.replace_all_uses_with(last, delete_user_cb=_not_in(made))
    copied.lint()
    laid_out = torch.fx.GraphModule(gm, copied)
    laid_out.meta.update(gm.meta)  # what Inductor reads of the trace (its shape environment)
    return laid_out


def _not_in(made: frozenset[torch.fx.Node]) -> Callable[[torch.fx.Node], bool]:
    """Which users of a node take the laid-out copy: all but the nodes that make it."""

    def takes_copy(user: torch.fx.Node) -> bool:
        return user not in made

    return takes_copy


def _viewed_node(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose tensor ``node``'s tensor views (itself when it views nothing); None when the
    chain of views cannot be followed back (a view made by something other than its first input)."""
    value = node.meta.get("example_value")
    while isinstance(value, torch.Tensor) and is_view(value):
        first = node.args[0] if node.args else None
        if node.op not in ("call_function", "call_method") or not isinstance(first, torch.fx.Node):
            return None
        node, value = first, first.meta.get("example_value")
    return node if isinstance(value, torch.Tensor) else None


# -- a tensor's layout class, as the call check compares it ----------------------------------
def layout_of(tensor: torch.Tensor) -> tuple[tuple[int, ...], bool]:
    """A tensor's layout class: its dims from outermost to innermost stride, and whether it is
    dense (no gaps, no overlap). Two tensors of one class and one shape have equal strides."""
    strides = tensor.stride()
    order = tuple(sorted(range(tensor.dim()), key=lambda d: (-strides[d], d)))
    return order, is_dense(tensor)


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether a tensor's elements fill its storage span without gaps or overlap (a permutation
    of a contiguous tensor). Dims of size 1 have no meaningful stride."""
    if tensor.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted(
        (st, sz) for sz, st in zip(tensor.shape, tensor.stride(), strict=True) if sz != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def to_layout(tensor: torch.Tensor, expected: Any) -> torch.Tensor:
    """A copy of ``tensor`` in the layout an assumption expected (contiguous, strides or class)."""
    if expected is True:
        return tensor.contiguous()
    if isinstance(expected, tuple) and len(expected) == 2 and isinstance(expected[1], bool):
        order = list(expected[0])
        inverse = sorted(range(len(order)), key=order.__getitem__)
        return tensor.permute(order).contiguous().permute(inverse)
    return torch.empty_strided(tensor.shape, expected, dtype=tensor.dtype, device=tensor.device).copy_(tensor)
