"""What compiling a piece needs, as records: a piece's compile inputs (``PieceWork``; ``Work``, what
any piece to compile offers, a loaded one's too) and one artifact to obtain (``Job``). The
background compile and the learning (schedule.py, size_learning.py) make them; the compile
workers' fan-out (compile_pool.py) takes them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tessera.compilation.piece import specialize_inputs
from tessera.compilation.split import SplitItem
from tessera.config import Shape, Size


class Work(Protocol):
    """A piece to compile at some size: the piece, its content hash (which names its artifacts),
    and its example inputs at a size, made when a compile needs them."""

    @property
    def item(self) -> SplitItem: ...

    @property
    def content(self) -> str: ...

    def inputs(self, size: Size) -> Callable[[], Sequence[Any]]: ...


@dataclass(frozen=True)
class PieceWork:
    """What compiling one piece at any size needs: the piece, its example inputs as traced (fake)
    and as the first call gave them (real; None where the trace made the value), and its content
    hash (cache/key.piece_content), which names its artifacts."""

    item: SplitItem
    fake_args: Sequence[Any]
    real_args: Sequence[Any | None]
    content: str

    def inputs(self, size: Size) -> Callable[[], Sequence[Any]]:
        """The example inputs of a compile at ``size``, made when the compile needs them: a static
        size's specialised to it, the fake ones as traced otherwise."""
        if isinstance(size, int | Shape):
            return functools.partial(specialize_inputs, self.item.name, self.fake_args, self.real_args, size)
        return functools.partial(_as_is, self.fake_args)


@dataclass(frozen=True)
class Job:
    """One artifact to obtain: ``work``'s piece at ``size`` (None: the general artifact)."""

    work: Work
    size: Size


def general_first(jobs: Iterable[Job]) -> list[Job]:
    """``jobs`` in the order the background takes them: every general artifact first, then the
    sizes and ranges, each group in the order given."""
    return sorted(jobs, key=lambda job: job.size is not None)


def _as_is(values: Sequence[Any]) -> Sequence[Any]:
    return values
