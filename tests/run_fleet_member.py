"""Subprocess helper: one replica (or one torchrun rank) of a fleet compiling the toy Llama.

Usage: python -m tests.run_fleet_member OUT_DIR [--backend inductor] [--layers 2] [--barrier DIR]
       [--hold DIR] [--distributed] [--rank-width]
Writes OUT_DIR/early/<name>.json once a trace serves (counters, whether outputs matched eager, calls
served as traced), then OUT_DIR/<name>.json once every compile is done (counters, whether outputs
matched eager, seconds to first output).
Under torchrun (--distributed) it joins a gloo group first; --rank-width gives each rank its own
model width, so the ranks' graphs differ. --hold DIR: the fleet's first compile (the lease
holder's) creates DIR/holder and waits there for DIR/release, so a test can act while it holds.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import tessera
import tessera.compilation.compilers
from tessera.models import toy_llama


def _held(compile_: Callable[..., Any], gate: Path) -> Callable[..., Any]:
    """``compile_``, except that the fleet's first compile waits at ``gate`` until released."""

    @functools.wraps(compile_)
    def held(*args: Any, **kwargs: Any) -> Any:
        try:
            os.close(os.open(gate / "holder", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return compile_(*args, **kwargs)
        deadline = time.monotonic() + 300
        while not (gate / "release").exists():
            assert time.monotonic() < deadline, "the test never released the holder"
            time.sleep(0.01)
        return compile_(*args, **kwargs)

    return held


def main() -> int:
    start = time.time()
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("tessera.cache.remote").setLevel(logging.INFO)  # the tests read its waits
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--barrier")
    parser.add_argument("--hold")
    parser.add_argument("--exit-early", action="store_true", help="exit once a trace serves")
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
    if args.hold:
        compiler = {
            "eager": tessera.compilation.compilers.EagerCompiler,
            "inductor": tessera.compilation.compilers.InductorCompiler,
        }
        cls = compiler[args.backend]
        cls.compile = _held(cls.compile, Path(args.hold))  # type: ignore[method-assign]
        if hasattr(cls, "job"):  # a compile sent to a worker is held as it is sent, in the lease
            cls.job = _held(cls.job, Path(args.hold))  # type: ignore[attr-defined]
    model = toy_llama.build(num_layers=args.layers, hidden_size=width, intermediate_size=2 * width)
    compiled = tessera.compile(model, backend=args.backend)
    matched = True
    with torch.no_grad():
        called = time.time()
        first = compiled(*toy_llama.example_inputs(7))
        first_output_at = time.time()
        first_output = first_output_at - start
        call_seconds = first_output_at - called
        matched = bool(torch.allclose(first, model(*toy_llama.example_inputs(7)), atol=1e-4, rtol=1e-4))
        for n in (3, 12):
            ids, pos = toy_llama.example_inputs(n)
            same = torch.allclose(compiled(ids, pos), model(ids, pos), atol=1e-4, rtol=1e-4)
            matched = matched and bool(same)
        # Once a trace serves: more calls, served as traced (or compiled, or loaded), then a
        # record of what served, written while the fleet may still be compiling.
        compiled.wait_traced()
        for n in (5, 9):
            ids, pos = toy_llama.example_inputs(n)
            matched = matched and bool(
                torch.allclose(compiled(ids, pos), model(ids, pos), atol=1e-4, rtol=1e-4)
            )
    report = compiled.report
    early = {
        "counters": tessera.counters.snapshot(),
        "matched": matched,
        "served_as_traced": sum(a.served for a in report.artifacts if a.source == "as traced")
        if report
        else 0,
    }
    Path(args.out, "early").mkdir(exist_ok=True)
    Path(args.out, "early", f"{name}.json").write_text(json.dumps(early))
    if args.exit_early:  # a short-lived process: exits while the fleet may still be compiling
        return 0
    compiled.wait_ready()  # the counters below: every compile or load done
    report = {
        "counters": tessera.counters.snapshot(),
        "matched": matched,
        "first_output_seconds": first_output,
        "first_output_at": first_output_at,  # wall clock, to compare with a test's own events
        "call_seconds": call_seconds,  # the first call alone, without starting Python and torch
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
