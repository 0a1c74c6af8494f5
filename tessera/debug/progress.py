"""What a cold compile is doing now: a progress bar on a terminal, one log line per piece elsewhere.

``TESSERA_PROGRESS=0`` turns both off. The bar (``rich``) shows pieces x sizes done, the piece
being compiled and the time elapsed; it is only imported when a terminal will show it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, NamedTuple

log = logging.getLogger(__name__)


def enabled() -> bool:
    value = os.environ.get("TESSERA_PROGRESS", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


class Timing(NamedTuple):
    """One artifact of a piece obtained: its size's label, the seconds it took and how."""

    size: str
    seconds: float
    source: str  # "compiled", "loaded" or "shared"


class CompileProgress:
    """Advanced once per artifact compiled or loaded; ``piece_done`` once per piece."""

    def __init__(self, model: str, total: int) -> None:
        self.model = model
        self.total = total
        self.done = 0
        self._bar: Any = None
        self._task: Any = None
        self._on = enabled() and total > 0
        if self._on and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("[bold]tessera[/bold] {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=False,
                console=Console(file=sys.stderr),  # stdout belongs to the user's program
            )
            self._bar.start()
            self._task = self._bar.add_task(f"{model}: compiling", total=total)

    def start(self, piece: str, size: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.model}: {piece} ({size})")

    def advance(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)

    def piece_done(self, piece: str, timings: list[Timing]) -> None:
        """One INFO line per piece when there is no bar: each size, how it was obtained, seconds."""
        if self._on and self._bar is None:
            parts = ", ".join(f"{size} {source} {seconds:.2f}s" for size, seconds, source in timings)
            log.info("%s: %s done (%d/%d): %s", self.model, piece, self.done, self.total, parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=f"{self.model}: compiled")
            self._bar.stop()
            self._bar = None
