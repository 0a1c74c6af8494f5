"""Eager's own noise on this machine: one model's eager calls, one every ``--gap`` seconds, per
intra-op thread count and with garbage collection on and off; JSON out.

The first-minute bar (benchmarks/first_minute.py) reads tessera's calls against eager's median;
this says how often eager alone misses it. Each configuration runs in a fresh process.

``python -m benchmarks.eager_noise [--model bert] [--seconds 6] [--threads 0,1]``
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from benchmarks import child_env, header


def child(name: str, threads: int, collect: bool, seconds: float, gap: float) -> dict[str, Any]:
    import torch

    from benchmarks.first_minute import SIZES, _build

    if threads:
        torch.set_num_threads(threads)
    if not collect:
        gc.disable()
    model, inputs = _build(name)
    args = inputs(SIZES[name][1])
    calls: list[tuple[float, float]] = []
    with torch.inference_mode():
        for _ in range(20):  # warm-up
            model(*args)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            before = time.perf_counter()
            model(*args)
            calls.append((before - start, time.perf_counter() - before))
            time.sleep(gap)
    median = statistics.median(took for _, took in calls)
    slow = [at for at, took in calls if took > 2 * median]
    return {
        "threads": torch.get_num_threads(),
        "gc": collect,
        "calls": len(calls),
        "median_ms": round(median * 1e3, 3),
        "calls_over_2x": len(slow),
        "worst_ratio": round(max(took for _, took in calls) / median, 2),
        "over_2x_per_second": round(len(slow) / seconds, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--threads", default="0,1", help="intra-op thread counts (0: torch's default)")
    parser.add_argument("--child", nargs=2, metavar=("THREADS", "GC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        threads, collect = int(args.child[0]), args.child[1] == "on"
        print(json.dumps(child(args.model, threads, collect, args.seconds, args.gap)))
        return 0
    runs = []
    for threads in (int(t) for t in args.threads.split(",")):
        for collect in ("on", "off"):
            command = [sys.executable, "-m", "benchmarks.eager_noise", "--model", args.model]
            command += ["--seconds", str(args.seconds), "--gap", str(args.gap)]
            command += ["--child", str(threads), collect]
            done = subprocess.run(command, env=child_env(), capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(json.dumps({**header("eager_noise"), "model": args.model, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
