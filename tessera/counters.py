"""Process-wide work counters: how many traces, pieces, compilations and cache hits happened.

Tests assert on them (``counters.expect``); the CLI and benchmarks print them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

NAMES = (
    "graphs_traced",  # graphs split and compiled (or loaded) from a trace
    "graphs_shared",  # traces whose graph one of the model's earlier traces had: nothing compiled
    "pieces",
    "compiled_pieces",
    "backend_compilations",
    "cache_hits",
    "cache_misses",
    "inductor_compiles",
    "eager_compiles",
    "artifacts_saved",
    "artifacts_loaded",
    "cudagraphs_captured",
    "sizes_learnt",  # static sizes compiled because the traffic had them (compile_sizes="auto")
    "sizes_retired",  # learnt sizes taken out for hotter ones
    "served_eagerly",  # calls the model's forward served while their trace was made (beside.py)
    # Piece calls whose sizes were outside what the chosen artifact's compile assumed (a size it
    # fixed: Inductor's Eq(s, 14) at a window's edge): run as traced, eager's kernels (piece.py).
    "outside_assumptions",
    "compile_workers_started",  # compile worker processes started (compile_pool.py)
    # The remote tier: requests made to its store (Redis commands, object-store HTTP requests),
    # those that write (PUTs: an object store bills them at about ten times a GET), and the blob
    # bytes moved each way.
    "remote_requests",
    "remote_writes",
    "remote_bytes_read",
    "remote_bytes_written",
    # Milliseconds lost to a failing store (attempts that failed, pauses between them): at most
    # the tier's budget, TESSERA_REMOTE_TIMEOUT_SECONDS, for the life of the process.
    "remote_fault_ms",
    # Fallbacks (report.Fallback): a piece artifact the index vouched for but that could not serve
    # (damaged, untrusted) was obtained again; a whole-model artifact was found but not used.
    "artifact_fallbacks",
    "warm_start_fallbacks",
)

_lock = threading.Lock()
_values: dict[str, int] = dict.fromkeys(NAMES, 0)


def bump(name: str, by: int = 1) -> None:
    """Add ``by`` to counter ``name`` (an internal invariant: the name must be known)."""
    assert name in _values, f"unknown counter {name!r}"
    with _lock:
        _values[name] += by


def snapshot() -> dict[str, int]:
    """A copy of every counter's current value."""
    with _lock:
        return dict(_values)


def reset() -> None:
    """Set every counter back to zero."""
    with _lock:
        for name in _values:
            _values[name] = 0


@contextlib.contextmanager
def expect(**deltas: int) -> Iterator[None]:
    """Check that the body changes the named counters by exactly ``deltas``.

    >>> with expect(graphs_traced=1, pieces=5):
    ...     compiled(x)
    """
    unknown = sorted(set(deltas) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown counter name(s) {unknown}; known: {list(NAMES)}")
    before = snapshot()
    yield
    after = snapshot()
    got = {name: after[name] - before[name] for name in deltas}
    if got != deltas:
        wrong = {n: f"expected {deltas[n]}, got {got[n]}" for n in deltas if got[n] != deltas[n]}
        raise AssertionError(f"counter deltas differ: {wrong}")
