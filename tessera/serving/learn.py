"""Sizes learnt from traffic (``compile_sizes="auto"``): count the sizes a trace serves, and pick
the ones worth a static artifact.

``SizeTally`` sits on the first sized piece of a trace and counts every call's size, and which
artifact served it (the report's histogram). With a ``SizeLearner`` it also keeps a decayed count
(a share of *recent* calls): every ``EVERY`` calls the learner looks at the shares, and a size
that holds at least ``share`` of them is handed to ``learn`` (compiled statically in the
background and swapped in by the backend). At most ``limit`` sizes are learnt; when a hotter size
needs a place, the coldest learnt one is retired, but only if the newcomer's share is at least
twice the retired one's, so two sizes of similar heat do not take turns compiling. A size is
learnt only once it has been seen in each of the last two windows of ``EVERY`` calls: traffic
confirms it, where a burst at start-up (a warm-up call, a health check's size) does not.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tessera.config import Counted, by_size

log = logging.getLogger(__name__)

# Calls between two looks at the shares. A look costs a pass over the distinct sizes seen.
EVERY = 64
# Each look multiplies the counts by this: a call's weight halves every ~11 looks (~700 calls),
# so the shares follow the traffic of the last few thousand calls, not of the whole process.
DECAY = 0.94
# The share a size needs by default (CompileConfig.auto_sizes_share); see docs/auto-sizes.md for
# the measurement behind it.
# A newcomer takes the coldest learnt size's place only when its share is this many times larger.
RETIRE_RATIO = 2.0


@dataclass(frozen=True)
class LearntSize:
    """A size learnt, and its share of recent calls when it was."""

    size: Counted
    share: float


class SizeLearner:
    """Decides which sizes to specialise from the recent shares of the sizes served.

    ``learn(size)`` must start the static compile (and return at once); the learner counts the
    size as learnt from then on. ``retire(size)`` takes a learnt size's artifact out.
    ``ready()`` says whether a compile may start now (the trace's own compiles come first).
    """

    def __init__(
        self,
        limit: int,
        share: float,
        listed: Iterable[Counted],
        learnt: Iterable[Counted],
        learn: Callable[[Counted], None],
        retire: Callable[[Counted], None],
        ready: Callable[[], bool],
    ) -> None:
        self.limit = limit
        self.share = share
        self._listed: frozenset[Counted] = frozenset(listed)
        self.learnt: tuple[Counted, ...] = tuple(s for s in learnt if s not in self._listed)[:limit]
        self._learn = learn
        self._retire = retire
        self._ready = ready
        self._recent: dict[Counted, float] = {}
        self._calls = 0
        # The sizes of the calls since the last look, and those seen in each of the last two
        # windows of EVERY calls: a size is learnt only once traffic has confirmed it, in two
        # windows in a row (a burst at start-up, a warm-up call, is not).
        self._window: dict[Counted, int] = {}
        self._confirmed: frozenset[Counted] = frozenset()
        self._previous: frozenset[Counted] = frozenset()
        self._look = threading.Lock()  # one look at a time; a call never waits for it
        self.events: list[tuple[str, LearntSize]] = []  # ("learnt" | "retired", size): the record

    def refuse(self, size: Counted) -> None:
        """A learnt size whose compile failed: no longer learnt, and never tried again."""
        self.learnt = tuple(s for s in self.learnt if s != size)
        self._listed = self._listed | {size}

    def seen(self, size: Counted) -> None:
        """One call of ``size`` (the hot path: a dict update, and a look every EVERY calls)."""
        recent = self._recent
        recent[size] = recent.get(size, 0.0) + 1.0
        window = self._window
        window[size] = window.get(size, 0) + 1
        self._calls += 1
        if self._calls % EVERY == 0:
            # The windows turn here, every EVERY calls, whether or not the look below runs (it
            # skips when another is under way).
            self._window = {}
            self._confirmed = self._previous & frozenset(window)
            self._previous = frozenset(window)
            self.look()

    def shares(self) -> dict[Counted, float]:
        """Each size's share of recent calls."""
        return _shares(dict(self._recent))  # a copy: calls in other threads go on counting

    def look(self, decay: bool = True) -> None:
        """Learn the size that holds ``share`` of recent calls (retiring a colder one for it).
        ``decay``: older calls weigh less from now on (the looks every EVERY calls)."""
        if not self._look.acquire(blocking=False):
            return
        try:
            recent = dict(self._recent)  # one copy (atomic): calls in other threads add sizes
            shares = _shares(recent)
            if decay:
                self._recent = {s: c * DECAY for s, c in recent.items() if c * DECAY >= 0.5}
            if not self._ready():
                return
            hot = sorted(
                (
                    s
                    for s, p in shares.items()
                    if p >= self.share and s not in self._listed and _positive(s) and s in self._confirmed
                ),
                key=lambda s: -shares[s],
            )
            for size in hot:
                if size in self.learnt:
                    continue
                if len(self.learnt) >= self.limit:
                    coldest = min(self.learnt, key=lambda s: shares.get(s, 0.0))
                    if shares[size] < RETIRE_RATIO * shares.get(coldest, 0.0):
                        continue
                    self.learnt = tuple(s for s in self.learnt if s != coldest)
                    self.events.append(("retired", LearntSize(coldest, shares.get(coldest, 0.0))))
                    log.info(
                        "auto sizes: %s retired (%.1f%% of recent calls)",
                        _label(coldest),
                        100 * shares.get(coldest, 0.0),
                    )
                    self._retire(coldest)
                self.learnt = (*self.learnt, size)
                self.events.append(("learnt", LearntSize(size, shares[size])))
                log.info("auto sizes: learning %s (%.1f%% of recent calls)", _label(size), 100 * shares[size])
                self._learn(size)
                return  # one compile per look: the next look sees the traffic again
        finally:
            self._look.release()


class SizeTally:
    """Every call's size and the label of the artifact that served it, since the process started
    (the report's histogram); and the learner, when sizes are learnt."""

    __slots__ = ("learner", "served")

    def __init__(self, learner: SizeLearner | None = None) -> None:
        self.learner = learner
        self.served: dict[tuple[Counted, str], int] = {}

    def seen(self, size: Counted, label: str) -> None:
        key = (size, label)
        served = self.served
        served[key] = served.get(key, 0) + 1
        if self.learner is not None:
            self.learner.seen(size)

    def histogram(self) -> tuple[tuple[Counted, str, int], ...]:
        """(size, artifact label, calls), by size."""
        return tuple(sorted(((s, label, n) for (s, label), n in dict(self.served).items()), key=by_size))


def _positive(size: Counted) -> bool:
    return all(v >= 1 for v in size) if isinstance(size, tuple) else size >= 1


def _label(size: Counted) -> str:
    return f"shape {'x'.join(map(str, size))}" if isinstance(size, tuple) else f"size {size}"


def _shares(recent: dict[Counted, float]) -> dict[Counted, float]:
    total = sum(recent.values())
    return {s: c / total for s, c in recent.items()} if total else {}
