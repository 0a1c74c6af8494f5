"""When the next call of a steady stream will start: the background stops before it, not in it.

Pacing (pacing.py) gives way to a call once the call has started. But a call starts only when its
thread has woken and taken the GIL, and on a small machine a background that runs right up to that
moment delays it three ways, all seen with ftrace on the 2-core CPU in the first seconds of tiny
BERT and ViT streams (``benchmarks/first_minute.py``, a call every 20 ms):

- the trace thread, importing Dynamo and Inductor, releases and retakes the GIL every few tens of
  microseconds (a file read, a stat): CPython's waiter is woken at each release and finds it taken
  again, and never asks for it (it asks only after a switch interval with no switch), so the call's
  thread waited 1 ms before its call began;
- the trace thread holds the GIL through a C call of milliseconds (a ``marshal`` of an imported
  module, the ``compile`` of generated code) that no trace function can interrupt;
- the trace thread holds one core, a system daemon woke on the other, and the call's thread woke
  behind the daemon (1-5 ms): eager alone would have run on the idle core.

A steady stream says when its next call will come. ``Arrivals`` learns that from the starts and ends
of the calls served (the time from one start to the next, and from an end to the next start; the
steadier of the two predicts; from the stream's fifth interval on, since what the background does
before then is what delays the stream's first calls), and while the prediction holds, a paced
thread stops ``LEAD`` before the predicted start (``Pacer.paced``) and waits for the call, or for
``miss`` past the prediction before it takes the stream for changed and runs on. The window takes
at most a third of the gap it is in (a stream of gaps under 9 ms, the decode loop of
``generate()``, gets none: the background needs them), and a stream that is not steady (a spread
of over a tenth of its period) is not predicted: the background then runs as pacing alone lets it.
The price is the background's time in the window, ``LEAD`` and the call's lateness on the
prediction per call (about a tenth of a 20 ms gap).
"""

from __future__ import annotations

import math

LEAD = 0.002  # seconds before a predicted call that paced threads stop
_MISS = 0.001  # seconds after it (at least) before the prediction is taken as missed
_SHARE = 3  # a window is at most this fraction (its inverse) of the gap it is in
_SEEN = 5  # intervals seen before a prediction (the last four give the spread)
_STEADY = 0.1  # the most spread, of the period, that still predicts
_WEIGHT = 0.2  # of each new interval in the averages
NO_WINDOW = (math.inf, math.inf)  # no call predicted: nothing waits for one


class _Fit:
    """A running average of one kind of interval, and of its spread (mean absolute deviation)."""

    __slots__ = ("mean", "seen", "spread")

    def __init__(self) -> None:
        self.mean = 0.0
        self.spread = math.inf
        self.seen = 0

    def add(self, interval: float) -> None:
        # Plain averages of the first few (the first interval has no spread to give: that starts
        # with the second), then running ones: a stream is known from its first handful of calls,
        # where the running averages alone would start from nothing and read as steady.
        if not self.seen:
            self.mean, self.spread = interval, 0.0
        else:
            self.spread += max(_WEIGHT, 1 / self.seen) * (abs(interval - self.mean) - self.spread)
            self.mean += max(_WEIGHT, 1 / (self.seen + 1)) * (interval - self.mean)
        self.seen += 1

    def steady(self) -> bool:
        return self.seen >= _SEEN and self.spread <= _STEADY * self.mean


class Arrivals:
    """The starts and ends of the calls a process serves (``started``, ``ended``: the first call
    of overlapping ones starts, the last ends), and the window paced threads stop in before the
    next (``window``). Not thread-safe: the pacer calls it under its lock."""

    def __init__(self) -> None:
        self._start: float | None = None
        self._end: float | None = None
        self._rate = _Fit()  # from a call's start to the next one's
        self._pause = _Fit()  # from a call's end to the next one's start
        self.window = NO_WINDOW  # [from, until): when paced threads wait for a call

    def started(self, at: float) -> None:
        if self._start is not None:
            self._rate.add(at - self._start)
        if self._end is not None:
            self._pause.add(at - self._end)
        self._start = at
        self.window = NO_WINDOW

    def ended(self, at: float) -> None:
        self._end = at
        fit = self._steadier()
        if fit is None:
            self.window = NO_WINDOW
            return
        due, miss = self._due(fit), max(_MISS, 3 * fit.spread)
        # The background needs the gaps: a window takes at most a third of one.
        self.window = NO_WINDOW if due - at < _SHARE * (LEAD + miss) else (due - LEAD, due + miss)

    def next_call(self) -> float | None:
        """When the next call will start, after the last one ended; None when the stream is not
        steady enough to say."""
        fit = self._steadier()
        return None if fit is None else self._due(fit)

    def _due(self, fit: _Fit) -> float:
        assert self._start is not None and self._end is not None  # a steady fit has seen both
        return (self._start if fit is self._rate else self._end) + fit.mean

    def _steadier(self) -> _Fit | None:
        # Both predict the same start: of the steady ones, the one that misses it by less (a
        # stream paced by its caller's sleep is steadier end to start; one at a fixed rate, start
        # to start). None while a call is served, or before either is steady.
        if self._start is None or self._end is None or self._end < self._start:
            return None
        steady = [fit for fit in (self._rate, self._pause) if fit.steady()]
        return min(steady, key=lambda fit: fit.spread) if steady else None
