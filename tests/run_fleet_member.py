"""Subprocess helper: one replica (or one torchrun rank) of a fleet compiling the toy Llama.

Usage: python -m tests.run_fleet_member OUT_DIR [--backend inductor] [--layers 2] [--barrier DIR]
       [--distributed] [--rank-width]
Writes OUT_DIR/<name>.json (counters, whether outputs matched eager, seconds to first output).
Under torchrun (--distributed) it joins a gloo group first; --rank-width gives each rank its own
model width, so the ranks' graphs differ.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

import tessera
from tessera.models import toy_llama


def main() -> int:
    start = time.time()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("tessera.cache.remote").setLevel(logging.INFO)  # the tests read its waits
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--barrier")
    parser.add_argument("--distributed", action="store_true")
    parser.add_argument("--rank-width", action="store_true")
    args = parser.parse_args()
    name = f"replica-{os.getpid()}"
    width = 64
    if args.distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        name = f"rank-{dist.get_rank()}"
        if args.rank_width:
            width = 32 * (dist.get_rank() + 1)
    if args.barrier:
        barrier = Path(args.barrier)
        (barrier / f"ready.{os.getpid()}").touch()
        while not (barrier / "go").exists():  # a start barrier, so all replicas race for real
            time.sleep(0.01)
    model = toy_llama.build(num_layers=args.layers, hidden_size=width, intermediate_size=2 * width)
    compiled = tessera.compile(model, backend=args.backend)
    matched = True
    with torch.no_grad():
        first = compiled(*toy_llama.example_inputs(7))
        first_output = time.time() - start
        matched = bool(torch.allclose(first, model(*toy_llama.example_inputs(7)), atol=1e-4, rtol=1e-4))
        for n in (3, 12):
            ids, pos = toy_llama.example_inputs(n)
            same = torch.allclose(compiled(ids, pos), model(ids, pos), atol=1e-4, rtol=1e-4)
            matched = matched and bool(same)
    report = {
        "counters": tessera.counters.snapshot(),
        "matched": matched,
        "first_output_seconds": first_output,
        "warm_start": compiled.warm_start,
    }
    Path(args.out, f"{name}.json").write_text(json.dumps(report))
    if args.distributed:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
