"""Shapes listed in ``compile_sizes`` (``[(4, 128), (1, 512)]``), read against one trace.

A listed shape gives the sizes of the model's input dims that vary, in order: ``(batch, length)``
for ``input_ids [batch, length]`` or ``inputs_embeds [batch, length, hidden]``, ``(batch, time)``
for audio ``[batch, channels, time]``. Each trace reads it against its first tensor input with a
dynamic size that it fits (the graph's inputs in the order the model's code first uses them). The
input's dims are walked in order: a dynamic dim (a symbol) takes the next value; a dim the trace
fixed is passed over, or, where the shape gives more values than dynamic dims are left, must equal
the next value. So a trace where Dynamo fixed the batch at 1 (a trace of its own for batch 1) reads
``(1, 128)`` as length 128 and does not take ``(4, 128)``; a trace where the batch and the length
vary takes ``(4, 128)``. A piece then compiles, for each shape the trace takes, its own sizes at
those values: a ``Shape`` where it varies in several, a size where in one (a piece that sees the
length alone compiles length 128), nothing where one of its sizes is not among those given.

``read_shapes`` is called once per trace (build.py); ``piece_statics`` once per sized piece.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx

from tessera import _compat
from tessera.config import Shape

log = logging.getLogger(__name__)

Dims = tuple[int | str, ...]  # an input's dims as traced: a size, or its symbol's name


@dataclass(frozen=True)
class TraceShapes:
    """The listed shapes as one trace reads them.

    ``source`` and ``dims``: the trace's first input with a dynamic size (what messages name);
    ``values``: for each shape this trace takes, the input it was read against and each symbol's
    value; ``skipped``: each listed shape it does not take, and why."""

    source: str = ""
    dims: Dims = ()
    values: tuple[tuple[tuple[int, ...], str, dict[str, int]], ...] = ()
    skipped: tuple[tuple[tuple[int, ...], str], ...] = ()

    @property
    def dynamic_dims(self) -> int:
        """How many dims of the first dynamic input vary in this trace."""
        return sum(isinstance(d, str) for d in self.dims)


def read_shapes(
    gm: torch.fx.GraphModule, shapes: Sequence[tuple[int, ...]], specialises_01: bool
) -> TraceShapes:
    """The listed ``shapes`` against the trace ``gm``. ``specialises_01``: Dynamo gives sizes 0 and
    1 traces of their own (backed dynamic shapes), so a dynamic size here never takes them."""
    inputs = [(name, dims) for name, dims in _compat.input_dims(gm) if any(isinstance(d, str) for d in dims)]
    if not inputs:
        return TraceShapes(skipped=tuple((s, "the trace has no dynamic size") for s in shapes))
    source, dims = inputs[0]
    if not shapes:  # where the listed sizes' warning says to look (build.py)
        return TraceShapes(source, dims)
    values = []
    skipped = []
    for shape in shapes:
        first_why = ""
        for name, input_dims in inputs:
            taken, why = _assign(shape, input_dims, specialises_01)
            if taken is not None:
                values.append((shape, name, taken))
                break
            first_why = first_why or why
        else:
            skipped.append((shape, f"{first_why} of {source}"))
    read = TraceShapes(source, dims, tuple(values), tuple(skipped))
    log.info("compile_sizes shapes in the trace whose input is %s: %s", input_text(read), describe(read))
    return read


def _assign(shape: tuple[int, ...], dims: Dims, specialises_01: bool) -> tuple[dict[str, int] | None, str]:
    """Each symbol's value where ``shape`` fits ``dims`` (see the module's docstring), else why not."""
    taken: dict[str, int] = {}
    left = list(shape)
    for i, dim in enumerate(dims):
        if isinstance(dim, int):
            # More values left than dynamic dims: this fixed dim is one of them, and must match.
            if left and len(left) > sum(isinstance(d, str) for d in dims[i + 1 :]):
                if left[0] != dim:
                    return None, f"dim {i} is {dim}"
                left.pop(0)
            continue
        if not left:
            return None, f"no value for dim {i}"
        value = left.pop(0)
        if not dim.isidentifier():  # a derived size (2*s0): its symbol is read elsewhere
            return None, f"dim {i} is {dim}, derived from another size"
        if specialises_01 and value < 2:
            return None, f"dim {i} of {value} has a trace of its own"
        if taken.setdefault(dim, value) != value:
            return None, f"dim {i} is the same size as an earlier dim, with another value"
    if left:
        return None, f"{len(shape)} values for {len(dims)} dims"
    return taken, ""


def piece_statics(read: TraceShapes, symbols: Sequence[Any]) -> tuple[int | Shape, ...]:
    """What one piece compiles for the listed shapes: ``symbols`` are its size symbols in
    ``piece.size_symbols`` order (a Shape's values are given in that order)."""
    names = [str(s) for s in symbols]
    out: list[int | Shape] = []
    for _, _, values in read.values:
        if not names or any(n not in values for n in names):
            continue
        static: int | Shape = values[names[0]] if len(names) == 1 else Shape(tuple(values[n] for n in names))
        if static not in out:
            out.append(static)
    return tuple(out)


def input_text(read: TraceShapes) -> str:
    """``args[0] [s33, s50, 8]``: the input the shapes are read against, as traced."""
    return f"{read.source} {_dims_text(read.dims)}" if read.source else "no input with a dynamic size"


def describe(read: TraceShapes) -> str:
    """``4x128 matched, 1x128 not (dim 0 is 1 of input_ids)``: for logs and warnings."""
    parts = [
        f"{_shape_text(s)} matched" + ("" if n == read.source else f" by {n}") for s, n, _ in read.values
    ]
    parts += [f"{_shape_text(s)} not ({why})" for s, why in read.skipped]
    return ", ".join(parts)


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _dims_text(dims: tuple[int | str, ...]) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"
