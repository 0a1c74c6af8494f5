"""``tessera demo``: compile the toy Llama, prove it matches eager, and show what it costs.

Prints pieces, per-piece compile time, per-call latency next to eager and stock torch.compile.
"""

from __future__ import annotations

import time

import torch

import tessera
from tessera.cli.timing import per_call_seconds
from tessera.lifecycle import Stage
from tessera.models import toy_llama

COMPILE_SIZES = [1, 16]
CHECK_SIZES = [1, 5, 16, 23, 64]  # 5, 23 and 64 are not compile sizes
TIMED_SIZES = [1, 16, 64]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f} ms"


def run_demo(layers: int = 4, hidden: int = 256, backend: str = "inductor") -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = toy_llama.build(
        num_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden, num_heads=8, num_kv_heads=4
    )
    print(f"tessera demo: toy Llama, {layers} layers, width {hidden}, compiler '{backend}'")
    compiled = tessera.compile(model, backend=backend, compile_sizes=COMPILE_SIZES, prefix="demo")
    ids, pos = toy_llama.example_inputs(8)
    print(f"  first call (compile sizes {COMPILE_SIZES} + general)...", flush=True)
    start = time.perf_counter()
    with torch.no_grad():  # a progress bar on a terminal (tessera.debug.progress)
        compiled(ids, pos)
    first = time.perf_counter() - start
    if compiled.stage is Stage.EAGER:  # cold: eager answered, the trace is made beside it
        print(f"  first output in {first:.2f}s, served eagerly; tracing beside it...", flush=True)
        compiled.wait_traced()
    report = compiled.report
    assert report is not None, "the first trace made a report"
    print(f"  {report.kind} start: first output in {first:.2f}s, traced in {report.phase('trace'):.1f}s")
    if not compiled.ready:
        print("  the rest compiles in the background; calls are served meanwhile...", flush=True)
        compiled.wait_ready()
        report = compiled.report
        assert report is not None and report.all_sizes_ready_seconds is not None
        print(f"  every size ready after {report.all_sizes_ready_seconds:.1f}s")

    counts = tessera.counters.snapshot()
    if counts["inductor_compiles"] == 0 and counts["cache_hits"]:
        traced = "no Dynamo trace" if counts["graphs_traced"] == 0 else "one Dynamo trace"
        print(f"  warm start: {counts['cache_hits']} artifacts loaded from the cache, {traced}")
    print("\npieces:")
    print(f"  {'piece':<10} {'kind':<10} artifacts (compile seconds)")
    for piece in compiled.pieces:
        kind = "split" if piece.is_splitting else "compiled"
        timings = piece.compile_seconds
        detail = ", ".join(f"{label} {sec:.2f}s" for label, sec in timings) or "runs eagerly"
        print(f"  {piece.name:<10} {kind:<10} {detail}")

    print("\nchecking against eager:", end=" ")
    with torch.no_grad():
        for n in CHECK_SIZES:
            ids, pos = toy_llama.example_inputs(n)
            torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
            print(f"{n}{'*' if n in COMPILE_SIZES else ''} ok", end="  ", flush=True)
    print("(* = compile size)")

    stock = torch.compile(model, backend=backend, dynamic=True)
    print("\n  compiling stock torch.compile for comparison...", flush=True)
    start = time.perf_counter()
    with torch.no_grad():
        stock(*toy_llama.example_inputs(8))
    print(f"  done in {time.perf_counter() - start:.1f}s")

    print(
        f"\nper-call latency (median):\n  {'tokens':>6} {'eager':>11} {'stock':>11} {'tessera':>11}  speed-up"
    )
    for n in TIMED_SIZES:
        args = toy_llama.example_inputs(n)
        eager_s = per_call_seconds(model, *args)
        stock_s = per_call_seconds(stock, *args)
        ours_s = per_call_seconds(compiled, *args)
        print(f"  {n:>6} {_ms(eager_s)} {_ms(stock_s)} {_ms(ours_s)}  {eager_s / ours_s:5.2f}x vs eager")

    where = compiled.cache_dir
    print(f"\nartifacts: {where if where is not None else 'kept in memory (cache disabled)'}")
    counts = tessera.counters.snapshot()
    print("counters: " + ", ".join(f"{k}={v}" for k, v in counts.items() if v))
    return 0
