"""The next call of a steady stream, predicted from the starts and ends of the calls served."""

from __future__ import annotations

import random
from collections.abc import Callable

from tessera.arrivals import _MISS, _SEEN, _SHARE, LEAD, NO_WINDOW, Arrivals

NONE = NO_WINDOW


def _serve(arrivals: Arrivals, starts_and_ends: list[tuple[float, float]]) -> None:
    for start, end in starts_and_ends:
        arrivals.started(start)
        arrivals.ended(end)


def test_a_stream_paced_by_its_callers_sleep_is_predicted_from_the_end_of_each_call():
    # Calls of 1-4 ms, each followed by a 20 ms sleep: the start to start varies by 3 ms, the end
    # to start by 0.1 ms.
    rng, arrivals, at, calls = random.Random(0), Arrivals(), 0.0, []
    for _ in range(20):
        end = at + rng.uniform(0.001, 0.004)
        calls.append((at, end))
        at = end + 0.020 + rng.uniform(0, 0.0001)
    _serve(arrivals, calls)
    last_end = calls[-1][1]
    due = arrivals.next_call()
    assert due is not None and abs(due - (last_end + 0.020)) < 0.0002
    start, until = arrivals.window
    assert abs(start - (due - LEAD)) < 1e-9 and due < until <= due + 0.002


def test_a_stream_at_a_fixed_rate_is_predicted_from_the_start_of_each_call():
    # A call every 25 ms, of 1-8 ms: the end to start varies by 7 ms, the start to start not.
    rng, arrivals = random.Random(1), Arrivals()
    calls = [(i * 0.025, i * 0.025 + rng.uniform(0.001, 0.008)) for i in range(20)]
    _serve(arrivals, calls)
    due = arrivals.next_call()
    assert due is not None and abs(due - 20 * 0.025) < 1e-6


def test_no_prediction_before_enough_calls_nor_for_an_irregular_stream():
    arrivals = Arrivals()
    _serve(arrivals, [(i * 0.02, i * 0.02 + 0.002) for i in range(_SEEN)])  # _SEEN - 1 intervals
    assert arrivals.next_call() is None and arrivals.window == NONE
    arrivals.started(_SEEN * 0.02)
    arrivals.ended(_SEEN * 0.02 + 0.002)
    assert arrivals.next_call() is not None and arrivals.window != NONE

    rng, irregular, at, calls = random.Random(2), Arrivals(), 0.0, []
    for _ in range(50):  # Poisson arrivals: nothing to predict
        calls.append((at, at + 0.002))
        at += 0.002 + rng.expovariate(1 / 0.02)
    _serve(irregular, calls)
    assert irregular.next_call() is None and irregular.window == NONE


def test_a_steady_stream_is_known_from_its_first_calls_and_an_irregular_one_is_not_taken_for_one():
    # What the background does before the stream is known is what delays its calls: the first
    # handful must do. A wrong prediction costs the background a window; over 500 streams each.
    def first_predicted(seed: int, step: Callable[[random.Random], float]) -> int | None:
        rng, arrivals, at = random.Random(seed), Arrivals(), 0.0
        for call in range(15):
            _serve(arrivals, [(at, at + 0.002)])
            if arrivals.next_call() is not None:
                return call
            at += 0.002 + step(rng)
        return None

    def predicted(step: Callable[[random.Random], float]) -> list[int | None]:
        return [first_predicted(seed, step) for seed in range(500)]

    assert set(predicted(lambda rng: rng.uniform(0.019, 0.021))) == {_SEEN}  # after _SEEN intervals
    poisson = predicted(lambda rng: rng.expovariate(1 / 0.02))
    assert sum(p is not None for p in poisson) <= 5
    uneven = predicted(lambda rng: rng.uniform(0.01, 0.03))  # +-50%
    assert sum(p is not None for p in uneven) <= 25


def test_no_window_while_a_call_is_served_nor_before_a_gap_too_short_to_give_up():
    arrivals = Arrivals()
    _serve(arrivals, [(i * 0.02, i * 0.02 + 0.002) for i in range(20)])
    assert arrivals.window != NONE
    arrivals.started(20 * 0.02)
    assert arrivals.window == NONE and arrivals.next_call() is None  # in a call: nothing due

    # Gaps of 8 ms: a window of 3 ms would take more than a third of each.
    short_gaps = Arrivals()
    _serve(short_gaps, [(i * 0.010, i * 0.010 + 0.002) for i in range(20)])
    assert short_gaps.next_call() is not None and _SHARE * (LEAD + _MISS) > 0.008
    assert short_gaps.window == NONE


def test_a_stream_that_pauses_is_not_predicted_until_it_is_steady_again():
    arrivals, at = Arrivals(), 0.0
    for _ in range(20):
        _serve(arrivals, [(at, at + 0.002)])
        at += 0.022
    assert arrivals.window != NONE
    at += 1.0  # a second with no calls
    _serve(arrivals, [(at, at + 0.002)])
    assert arrivals.window == NONE
    for _ in range(30):
        at += 0.022
        _serve(arrivals, [(at, at + 0.002)])
    due = arrivals.next_call()
    assert due is not None and abs(due - (at + 0.022)) < 0.001
