"""Shapes listed in ``compile_sizes`` (``[(4, 128), (1, 512)]``), read against one trace.

A listed shape gives the leading dims of the model's input: the graph's first tensor input with a
dynamic size (``input_ids [batch, length]``, or ``inputs_embeds [batch, length, hidden]``), one
value per dim from the first. In a trace, each of those dims is a symbol (a dynamic size), which
takes the shape's value, or a fixed size, which must equal it: a trace where Dynamo fixed the batch
at 1 (its own trace for size 1) takes ``(1, 128)`` and not ``(4, 128)``, the trace where the batch
varies the reverse. A piece then compiles, for each shape the trace takes, its own sizes at those
values: a ``Shape`` where it varies in several, a size where in one (a piece that sees the length
alone compiles length 128), nothing where one of its sizes is not among the dims given.

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


@dataclass(frozen=True)
class TraceShapes:
    """The listed shapes as one trace reads them.

    ``source``: the input whose leading dims they give, and its dims as traced (a size, or its
    symbol's name); ``values``: for each shape this trace takes, each symbol's value;
    ``skipped``: each listed shape it does not take, and why."""

    source: str = ""
    dims: tuple[int | str, ...] = ()
    values: tuple[tuple[tuple[int, ...], dict[str, int]], ...] = ()
    skipped: tuple[tuple[tuple[int, ...], str], ...] = ()


def read_shapes(
    gm: torch.fx.GraphModule, shapes: Sequence[tuple[int, ...]], specialises_01: bool
) -> TraceShapes:
    """The listed ``shapes`` against the trace ``gm``. ``specialises_01``: Dynamo gives sizes 0 and
    1 traces of their own (backed dynamic shapes), so a dynamic size here never takes them."""
    found = next(
        ((name, dims) for name, dims in _compat.input_dims(gm) if any(isinstance(d, str) for d in dims)),
        None,
    )
    if found is None:
        return TraceShapes(skipped=tuple((s, "the trace has no dynamic size") for s in shapes))
    source, dims = found
    if not shapes:  # where the listed sizes' warning says to look (build.py)
        return TraceShapes(source, dims)
    values = []
    skipped = []
    for shape in shapes:
        taken, why = _assign(shape, dims, specialises_01)
        if taken is None:
            skipped.append((shape, why))
        else:
            values.append((shape, taken))
    read = TraceShapes(source, dims, tuple(values), tuple(skipped))
    log.info("compile_sizes shapes read as the leading dims of %s: %s", input_text(read), describe(read))
    return read


def _assign(
    shape: tuple[int, ...], dims: tuple[int | str, ...], specialises_01: bool
) -> tuple[dict[str, int] | None, str]:
    if len(shape) > len(dims):
        return None, f"{len(shape)} values for an input of {len(dims)} dims"
    taken: dict[str, int] = {}
    for i, (value, dim) in enumerate(zip(shape, dims, strict=False)):
        if isinstance(dim, int):
            if dim != value:
                return None, f"dim {i} is {dim} in this trace"
            continue
        if not dim.isidentifier():  # a derived size (2*s0): its symbol is read elsewhere
            return None, f"dim {i} is {dim} in this trace, derived from another size"
        if specialises_01 and value < 2:
            return None, f"dim {i} of {value} has a trace of its own"
        if taken.setdefault(dim, value) != value:
            return None, f"dim {i} is the same size as an earlier dim, with another value"
    return taken, ""


def piece_statics(read: TraceShapes, symbols: Sequence[Any]) -> tuple[int | Shape, ...]:
    """What one piece compiles for the listed shapes: ``symbols`` are its size symbols in
    ``piece.size_symbols`` order (a Shape's values are given in that order)."""
    names = [str(s) for s in symbols]
    out: list[int | Shape] = []
    for _, values in read.values:
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
    """``4x128 taken, 1x128 not (dim 0 is 1 in this trace)``: for logs and warnings."""
    parts = [f"{_shape_text(s)} taken" for s, _ in read.values]
    parts += [f"{_shape_text(s)} not ({why})" for s, why in read.skipped]
    return ", ".join(parts)


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _dims_text(dims: tuple[int | str, ...]) -> str:
    return "[" + ", ".join(map(str, dims)) + "]"
