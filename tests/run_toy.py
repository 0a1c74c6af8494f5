"""Subprocess helper for cache tests: compile the toy Llama, run sizes, print counters as JSON.

Usage: python -m tests.run_toy OUT.pt [--backend inductor] [--layers 2] [--sizes 1,5,16]
Outputs are saved to OUT.pt so tests can compare processes bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

import tessera
from tessera.models import toy_llama

# Modules a warm start from the whole-model artifact must not import (Dynamo's tracer, Inductor).
HEAVY_MODULES = ("torch._dynamo", "torch._dynamo.symbolic_convert", "torch._inductor", "sympy")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sizes", default="3,16,17")
    parser.add_argument("--compile-sizes", default="16")
    parser.add_argument("--mode", default="piecewise")
    parser.add_argument("--barrier", help="directory: write ready.<pid>, wait for a 'go' file")
    args = parser.parse_args()
    if args.barrier:
        barrier = Path(args.barrier)
        (barrier / f"ready.{os.getpid()}").touch()
        while not (barrier / "go").exists():  # a start barrier, so all processes race for real
            time.sleep(0.01)
    model = toy_llama.build(num_layers=args.layers)
    compile_sizes = [int(s) for s in args.compile_sizes.split(",") if s]
    compiled = tessera.compile(model, backend=args.backend, compile_sizes=compile_sizes, mode=args.mode)
    sizes = [int(s) for s in args.sizes.split(",")]
    with torch.no_grad():
        outputs = {n: compiled(*toy_llama.example_inputs(n)) for n in sizes}
        # Before assert_close, which imports torch.distributed (and with it sympy).
        modules = {name: name in sys.modules for name in HEAVY_MODULES}
        for n in sizes:
            torch.testing.assert_close(outputs[n], model(*toy_llama.example_inputs(n)))
    torch.save(outputs, args.out)
    result = {
        "counters": tessera.counters.snapshot(),
        "cache_dir": str(compiled.cache_dir),
        "modules": modules,
        "warm_start": compiled.warm_start,
    }
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
