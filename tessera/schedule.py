"""What a model's pieces still need compiled, as records: a piece's compile inputs (``PieceWork``)
and one artifact to obtain (``Job``).

The trace leaves jobs for after the first output (serve first, specialise after); the background
thread takes them general artifacts first, so that pieces serving as traced get compiled code
soonest, then every compile size and range. A size learnt from traffic is one job per sized piece.
"""

from __future__ import annotations

import contextvars
import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tessera import _compat
from tessera.config import Size
from tessera.piece import specialize_inputs
from tessera.split import SplitItem


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
        if isinstance(size, int):
            return functools.partial(specialize_inputs, self.item.name, self.fake_args, self.real_args, size)
        return functools.partial(_as_is, self.fake_args)


@dataclass(frozen=True)
class Job:
    """One artifact to obtain: ``work``'s piece at ``size`` (None: the general artifact)."""

    work: PieceWork
    size: Size


def general_first(jobs: Iterable[Job]) -> list[Job]:
    """``jobs`` in the order the background takes them: every general artifact first, then the
    sizes and ranges, each group in the order given."""
    return sorted(jobs, key=lambda job: job.size is not None)


def start_thread(name: str, fn: Callable[..., None], *args: Any) -> threading.Thread:
    """Run ``fn(*args)`` in a compile thread of its own (the background compile, the learning).

    Not a daemon: a process that exits first waits for it, and the cache gets every artifact. A
    compile in another thread must not make this process's other torch.compile'd functions think
    they are being FX-traced, nor send the modules they call into its FX trace (torch 2.11-2.13,
    see _compat.isolate_fx_tracing). It runs in a copy of this thread's context: Inductor's and
    Dynamo's settings are context variables (torch 2.13: ``config.x = v`` sets a ContextVar), and
    a new thread starts with an empty context, so the user's settings, which the cache key has
    read, would be missing from the compile."""
    _compat.isolate_fx_tracing()
    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(fn, *args), name=name, daemon=False)
    thread.start()
    _compat.join_before_pools_shut(thread)
    return thread


def _as_is(values: Sequence[Any]) -> Sequence[Any]:
    return values
