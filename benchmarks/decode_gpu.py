"""Decode-step latency on a GPU: eager, stock torch.compile, reduce-overhead, tessera piecewise
and full CUDA graphs; plus capture time and pool memory. Prints JSON (needs CUDA)."""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import torch

import tessera
from benchmarks import header
from tessera.cli.timing import per_call_seconds
from tessera.models import toy_llama

BATCHES = (1, 8, 32, 128)


def _inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 256, (batch,), device="cuda")
    return ids, torch.full((batch,), 100, device="cuda")


def _tessera(model: torch.nn.Module, mode: str) -> tuple[Any, dict[str, float]]:
    compiled = tessera.compile(
        model,
        cudagraph_mode=mode,
        cudagraph_capture_sizes=list(BATCHES),
        disable_cache=True,
        background_compile=False,  # the compile timed at the first call, as a batch job has it
    )
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    start = time.perf_counter()
    with torch.no_grad():
        compiled(*_inputs(8))  # trace + compile (at a general size)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        for batch in sorted(BATCHES, reverse=True):  # largest first: later graphs reuse its pool
            compiled(*_inputs(batch))  # warm-up
            compiled(*_inputs(batch))  # capture + replay
    torch.cuda.synchronize()
    info = {
        "compile_s": compile_s,
        "capture_s": time.perf_counter() - start,
        "pool_bytes": torch.cuda.memory_reserved() - reserved,
        "graphs": tessera.counters.snapshot()["cudagraphs_captured"],
    }
    return compiled, info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_gpu needs a CUDA device")
    model = toy_llama.build_decode(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_heads=16,
        num_kv_heads=8,
        max_batch=max(BATCHES),
        max_len=128,
        dtype=torch.bfloat16,
        device="cuda",
    )
    impls: dict[str, Any] = {"eager": model}
    extra: dict[str, Any] = {}
    impls["stock_compile"] = torch.compile(copy.deepcopy(model), dynamic=True)
    impls["reduce_overhead"] = torch.compile(copy.deepcopy(model), mode="reduce-overhead")
    for mode in ("piecewise", "full"):
        tessera.counters.reset()
        impls[f"tessera_{mode}"], extra[f"tessera_{mode}"] = _tessera(copy.deepcopy(model), mode)
    rows = []
    for batch in BATCHES:
        args_ = _inputs(batch)
        row: dict[str, Any] = {"batch": batch}
        for name, fn in impls.items():
            row[f"{name}_ms"] = per_call_seconds(fn, *args_, warmup=5, repeats=11, inner=20) * 1e3
        row["piecewise_speedup_vs_eager"] = row["eager_ms"] / row["tessera_piecewise_ms"]
        row["piecewise_over_full"] = row["tessera_piecewise_ms"] / row["tessera_full_ms"]
        row["piecewise_over_reduce_overhead"] = row["tessera_piecewise_ms"] / row["reduce_overhead_ms"]
        rows.append(row)
    result = {
        **header("decode_gpu"),
        "model": {"layers": args.layers, "hidden": args.hidden, "dtype": "bfloat16"},
        "capture": extra,
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
