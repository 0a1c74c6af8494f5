"""Latency measurement shared by the demo and the benchmarks: warm up, then median of repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def _sync() -> None:
    # torch.cuda.is_initialized is untyped in torch's stubs.
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()


def per_call_seconds(
    fn: Callable[..., Any], *args: Any, warmup: int = 3, repeats: int = 7, inner: int = 10
) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` back-to-back calls of ``fn(*args)``."""
    with torch.no_grad():
        for _ in range(warmup):
            fn(*args)
        _sync()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(inner):
                fn(*args)
            _sync()
            samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)
