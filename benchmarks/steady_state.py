"""Steady-state per-call latency: eager vs stock torch.compile vs tessera, same process, JSON out.

``python -m benchmarks.steady_state [--quick] [--sections defaults ...]``. Also the dispatch
overhead of tessera with the ``eager`` compiler on a 12-layer tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import tessera
from benchmarks import header
from tessera.cli.timing import per_call_seconds
from tessera.models import toy_llama

SIZES = (1, 16, 64)
INDUCTOR_MODEL: dict[str, Any] = {
    "num_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_heads": 8,
    "num_kv_heads": 4,
}


def inductor_latency(repeats: int) -> dict[str, Any]:
    """Toy Llama (4 layers, width 256): per-call seconds for eager, stock and tessera."""
    sizes = INDUCTOR_MODEL
    model = toy_llama.build(**sizes)
    ours = tessera.compile(model, backend="inductor", compile_sizes=list(SIZES), disable_cache=True)
    stock = torch.compile(model, backend="inductor", dynamic=True)
    with torch.no_grad():
        ours(*toy_llama.example_inputs(8))
        stock(*toy_llama.example_inputs(8))
    # The steady state: every size compiled (background compile is on by default, and a compile
    # still running beside the timed calls measured the machine's contention, not the dispatch).
    ours.wait_ready(600)
    rows = []
    for n in SIZES:
        args = toy_llama.example_inputs(n)
        eager_s = per_call_seconds(model, *args, repeats=repeats)
        stock_s = per_call_seconds(stock, *args, repeats=repeats)
        ours_s = per_call_seconds(ours, *args, repeats=repeats)
        rows.append(
            {
                "tokens": n,
                "eager_ms": eager_s * 1e3,
                "stock_compile_ms": stock_s * 1e3,
                "tessera_ms": ours_s * 1e3,
                "tessera_over_stock": ours_s / stock_s,
                "tessera_over_eager": ours_s / eager_s,
            }
        )
    return {"model": sizes, "compiler": "inductor", "compile_sizes": list(SIZES), "rows": rows}


def dispatch_overhead(repeats: int) -> dict[str, Any]:
    """12 layers, tiny widths: tessera with the eager compiler against the eager model, with the
    per-call input check on (the default) and off (``check_inputs=False``)."""
    sizes: dict[str, Any] = {
        "num_layers": 12,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "num_kv_heads": 1,
    }
    model = toy_llama.build(**sizes)
    checked = tessera.compile(model, backend="eager", disable_cache=True)
    unchecked = tessera.compile(model, backend="eager", disable_cache=True, check_inputs=False)
    with torch.no_grad():
        checked(*toy_llama.example_inputs(8))
        unchecked(*toy_llama.example_inputs(8))
    rows = []
    for n in SIZES:
        args = toy_llama.example_inputs(n)
        eager_s = per_call_seconds(model, *args, repeats=repeats, inner=50)
        checked_s = per_call_seconds(checked, *args, repeats=repeats, inner=50)
        unchecked_s = per_call_seconds(unchecked, *args, repeats=repeats, inner=50)
        rows.append(
            {
                "tokens": n,
                "eager_ms": eager_s * 1e3,
                "tessera_eager_ms": checked_s * 1e3,
                "tessera_eager_unchecked_ms": unchecked_s * 1e3,
                "tessera_over_eager": checked_s / eager_s,
                "check_cost_us": (checked_s - unchecked_s) * 1e6,
            }
        )
    return {
        "model": sizes,
        "compiler": "eager",
        "check_assumptions": len(checked.call_spec.assumptions) if checked.call_spec else 0,
        "check_alone_us": _check_alone_us(checked),
        "rows": rows,
    }


def _check_alone_us(compiled: Any) -> float:
    """The call check on its own: the same generated check in front of a call that does nothing."""
    import timeit

    from tessera.trace import call_check

    assert compiled.call_spec is not None, "compile first"
    passed = []
    check = call_check.make_checked_call(
        compiled.call_spec, lambda *a, **k: passed.append(1), lambda a, k: None, compiled.check_namespace
    )
    args = toy_llama.example_inputs(16)
    number = 20000
    with torch.no_grad():  # as the calls run: grad enabled takes the slow path
        best = min(timeit.repeat(lambda: check(*args), number=number, repeat=5))
    assert len(passed) == number * 5, "the check must pass for what it measures to be the check"
    return best / number * 1e6


def _cold_compile(options: dict[str, Any]) -> tuple[Any, float]:
    """One way of compiling the 4-layer toy Llama, compiled on an empty Inductor cache; its seconds."""
    model = toy_llama.build(**INDUCTOR_MODEL)
    compiled = tessera.compile(model, backend="inductor", disable_cache=True, **options)
    # An empty Inductor cache directory: every variant's cold compile is a real one, whatever ran
    # before (Inductor reads the variable at each cache access).
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="tessera-variant-") as scratch:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch
        try:
            start = time.perf_counter()
            with torch.no_grad():
                compiled(*toy_llama.example_inputs(8))
            cold = time.perf_counter() - start
        finally:
            if previous is None:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    return compiled, cold


VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("piecewise, backed", {}),
    ("graph partition", {"graph_partition": True}),
    ("piecewise, unbacked", {"dynamic_shapes": "unbacked"}),
    ("piecewise, backed_size_oblivious", {"dynamic_shapes": "backed_size_oblivious"}),
)


def variants(repeats: int) -> list[dict[str, Any]]:
    """Piecewise (backed, the default) against graph partition and the other dynamic-shape modes.

    Everything is compiled first; then each round times every variant at every size in turn, and a
    figure is the median over the rounds. Timing one variant after another let whatever the
    machine did meanwhile (Inductor's compile workers settling, another process) land on one
    variant alone and read as a difference between modes.
    """
    rows: list[dict[str, Any]] = [{"variant": "eager (reference)"}]
    fns: list[Any] = [toy_llama.build(**INDUCTOR_MODEL)]
    for name, options in VARIANTS:
        compiled, cold = _cold_compile(options)
        rows.append({"variant": name, "options": options, "cold_compile_seconds": cold})
        fns.append(compiled)
    samples: dict[tuple[int, int], list[float]] = {}
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            for n in SIZES:
                seconds = per_call_seconds(fn, *toy_llama.example_inputs(n), warmup=1, repeats=1)
                samples.setdefault((i, n), []).append(seconds)
    for (i, n), values in samples.items():
        rows[i][f"ms_{n}_tokens"] = statistics.median(values) * 1e3
    return rows


def defaults(repeats: int) -> dict[str, Any]:
    """tessera as a new user calls it: the default background compile, parameters as the model
    made them (requiring grad), calls under ``torch.no_grad()``; against the same model compiled
    up front (``background_compile=False``), stock ``torch.compile`` and eager, every size ready.

    A background compile once ran with grad enabled (a new thread's default) and compiled the
    pieces for autograd: this is the figure that shows it does not. Timed in interleaved rounds
    (as ``variants``), each figure the median over the rounds.
    """
    model = toy_llama.build(**INDUCTOR_MODEL).requires_grad_(True)
    options: dict[str, Any] = {"backend": "inductor", "compile_sizes": list(SIZES), "disable_cache": True}
    default = tessera.compile(model, background_compile=True, **options)
    up_front = tessera.compile(model, background_compile=False, **options)
    stock = torch.compile(model, backend="inductor", dynamic=True)
    fns: dict[str, Callable[..., Any]] = {
        "eager": model,
        "stock": stock,
        "default": default,
        "up_front": up_front,
    }
    with torch.no_grad():
        for fn in fns.values():
            fn(*toy_llama.example_inputs(8))
    assert default.wait_ready(1800), "the background compile did not finish"
    background = default.report.background if default.report is not None else "none"
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            for n in SIZES:
                seconds = per_call_seconds(fn, *toy_llama.example_inputs(n), warmup=1, repeats=1)
                samples.setdefault((name, n), []).append(seconds)
    rows = []
    for n in SIZES:
        ms = {name: statistics.median(samples[(name, n)]) * 1e3 for name in fns}
        rows.append(
            {
                "tokens": n,
                **{f"{name}_ms": value for name, value in ms.items()},
                "default_over_stock": ms["default"] / ms["stock"],
                "default_over_up_front": ms["default"] / ms["up_front"],
                "default_over_eager": ms["default"] / ms["eager"],
            }
        )
    return {
        "model": INDUCTOR_MODEL,
        "parameters_require_grad": True,
        "compile_sizes": list(SIZES),
        "background": background,
        "rows": rows,
    }


def traces(repeats: int) -> dict[str, Any]:
    """The call at batch 1 (one token) when a model holds one trace, when it holds several (the
    other traces made by calls with positions of other integer dtypes), and when calls alternate
    between two traces (each call then passes the check of the trace that served last after failing
    the other's). The eager compiler on a 12-layer tiny model shows tessera's own cost per call;
    the 4-layer Inductor model what a user sees. Interleaved rounds, medians; against eager.
    """
    tiny: dict[str, Any] = {
        "num_layers": 12,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "num_kv_heads": 1,
    }
    out: dict[str, Any] = {}
    for label, sizes, backend in (
        ("eager_compiler", tiny, "eager"),
        ("inductor", INDUCTOR_MODEL, "inductor"),
    ):
        model = toy_llama.build(**sizes)
        one = tessera.compile(model, backend=backend, disable_cache=True)
        several = tessera.compile(model, backend=backend, disable_cache=True)
        ids, positions = toy_llama.example_inputs(1)
        others = [(ids, positions.int()), (ids.int(), positions), (ids.int(), positions.int())]
        with torch.no_grad():
            one(ids, positions)
            for call in [(ids, positions), *others]:
                several(*call)
            several(ids, positions)  # served last: the batch-1 trace
        alternating_calls = [(ids, positions), others[0]]

        fns: dict[str, Callable[..., Any]] = {"eager": model, "one_trace": one, "several_traces": several}
        samples: dict[str, list[float]] = {}
        for _ in range(repeats):
            for name, fn in fns.items():
                seconds = per_call_seconds(fn, ids, positions, warmup=2, repeats=1, inner=20)
                samples.setdefault(name, []).append(seconds)
            pair = per_call_seconds(_alternate, several, alternating_calls, warmup=2, repeats=1, inner=20) / 2
            eager_pair = (
                per_call_seconds(_alternate, model, alternating_calls, warmup=2, repeats=1, inner=20) / 2
            )
            samples.setdefault("alternating", []).append(pair)
            samples.setdefault("eager_alternating", []).append(eager_pair)
        ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        out[label] = {
            "model": sizes,
            "traces_held": {"one_trace": len(one.traces), "several_traces": len(several.traces)},
            **{f"{name}_ms": value for name, value in ms.items()},
            "one_trace_over_eager": ms["one_trace"] / ms["eager"],
            "several_traces_over_eager": ms["several_traces"] / ms["eager"],
            "alternating_over_eager": ms["alternating"] / ms["eager_alternating"],
        }
    return out


def _alternate(fn: Callable[..., Any], calls: list[tuple[Any, ...]]) -> None:
    for call in calls:
        fn(*call)


SECTIONS = {
    "traces": traces,
    "dispatch_overhead": dispatch_overhead,
    "inductor": inductor_latency,
    "variants": variants,
    "defaults": defaults,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 15")
    parser.add_argument("--sections", nargs="*", choices=list(SECTIONS), default=list(SECTIONS))
    args = parser.parse_args(argv)
    repeats = 5 if args.quick else 15
    torch.manual_seed(0)
    result = {**header("steady_state"), **{name: SECTIONS[name](repeats) for name in args.sections}}
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
