"""Steady-state per-call latency: eager vs stock torch.compile vs tessera, same process, JSON out.

Also the dispatch overhead of tessera with the ``eager`` compiler on a 12-layer tiny model.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import tessera
from tessera.cli.bench import header
from tessera.models import toy_llama
from tessera.timing import per_call_seconds

SIZES = (1, 16, 64)


def inductor_latency(repeats: int) -> dict[str, Any]:
    """Toy Llama (4 layers, width 256): per-call seconds for eager, stock and tessera."""
    sizes: dict[str, Any] = {
        "num_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_heads": 8,
        "num_kv_heads": 4,
    }
    model = toy_llama.build(**sizes)
    ours = tessera.compile(model, backend="inductor", compile_sizes=list(SIZES), disable_cache=True)
    stock = torch.compile(model, backend="inductor", dynamic=True)
    with torch.no_grad():
        ours(*toy_llama.example_inputs(8))
        stock(*toy_llama.example_inputs(8))
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
    """12 layers, tiny widths: tessera with the eager compiler against the eager model."""
    sizes: dict[str, Any] = {
        "num_layers": 12,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "num_kv_heads": 1,
    }
    model = toy_llama.build(**sizes)
    ours = tessera.compile(model, backend="eager", disable_cache=True)
    with torch.no_grad():
        ours(*toy_llama.example_inputs(8))
    rows = []
    for n in SIZES:
        args = toy_llama.example_inputs(n)
        eager_s = per_call_seconds(model, *args, repeats=repeats, inner=50)
        ours_s = per_call_seconds(ours, *args, repeats=repeats, inner=50)
        rows.append(
            {
                "tokens": n,
                "eager_ms": eager_s * 1e3,
                "tessera_eager_ms": ours_s * 1e3,
                "tessera_over_eager": ours_s / eager_s,
            }
        )
    return {"model": sizes, "compiler": "eager", "rows": rows}


def main(quick: bool = False) -> int:
    repeats = 5 if quick else 15
    torch.manual_seed(0)
    result = {
        **header("steady_state"),
        "dispatch_overhead": dispatch_overhead(repeats),
        "inductor": inductor_latency(repeats),
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0
