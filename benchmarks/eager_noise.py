"""Eager's own noise on this machine: one model's eager calls, one every ``--gap`` seconds, per
intra-op thread count and with garbage collection on and off; JSON out. ``--impls`` adds the same
stream of compiled calls once every compile is done (stock ``torch.compile``, tessera on its
defaults after ``wait_ready``): the noise of Inductor's code on this machine, the steady state
after the first minute.

The first-minute bar (benchmarks/first_minute.py) reads tessera's calls against eager's median;
this says how often eager alone misses it, and how often compiled code does. Each configuration
runs in a fresh process (tessera's with an empty cache of its own).

``python -m benchmarks.eager_noise [--model bert] [--seconds 6] [--threads 0,1]
[--impls eager,stock,tessera] [--gc on,off]``
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import child_env, header


def child(
    name: str, threads: int, collect: bool, seconds: float, gap: float, impl: str = "eager"
) -> dict[str, Any]:
    import torch

    from benchmarks.first_minute import SIZES, _build

    if threads:
        torch.set_num_threads(threads)
    if not collect:
        gc.disable()
    model, inputs = _build(name)
    args = inputs(SIZES[name][1])
    if impl == "stock":
        model = torch.compile(model)
    elif impl == "tessera":
        import tessera

        model = tessera.compile(model)
    calls: list[tuple[float, float]] = []
    with torch.inference_mode():
        model(*args)
        if impl == "tessera":
            model.wait_ready()  # every compile done: the steady state
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
        "impl": impl,
        "threads": torch.get_num_threads(),
        "gc": collect,
        "calls": len(calls),
        "median_ms": round(median * 1e3, 3),
        "calls_over_2x": len(slow),
        "worst_ratio": round(max(took for _, took in calls) / median, 2),
        "over_2x_per_second": round(len(slow) / seconds, 2),
        "took": [took for _, took in calls],  # main reads it and leaves it out of its JSON
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--threads", default="0,1", help="intra-op thread counts (0: torch's default)")
    parser.add_argument(
        "--impls", default="eager", help="eager, stock (torch.compile), tessera; comma-separated"
    )
    parser.add_argument("--gc", default="on,off", help="garbage collection on, off, or both")
    parser.add_argument("--child", nargs=3, metavar=("THREADS", "GC", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        threads, collect, impl = int(args.child[0]), args.child[1] == "on", args.child[2]
        print(json.dumps(child(args.model, threads, collect, args.seconds, args.gap, impl)))
        return 0
    runs = []
    for impl in args.impls.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            for collect in args.gc.split(","):
                command = [sys.executable, "-m", "benchmarks.eager_noise", "--model", args.model]
                command += ["--seconds", str(args.seconds), "--gap", str(args.gap)]
                command += ["--child", str(threads), collect, impl]
                with tempfile.TemporaryDirectory() as cache:
                    env = child_env(
                        TESSERA_CACHE_DIR=f"{cache}/tessera", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor"
                    )
                    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    # The first minute's bar is eager's median, not a run's own: each run's calls against the median
    # of eager's run with the same threads and collection, where there is one.
    eager = {(r["threads"], r["gc"]): r["median_ms"] / 1e3 for r in runs if r["impl"] == "eager"}
    for run in runs:
        took = run.pop("took")
        median = eager.get((run["threads"], run["gc"]))
        if median is not None:
            run["calls_over_2x_eager_median"] = sum(t > 2 * median for t in took)
    print(json.dumps({**header("eager_noise"), "model": args.model, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
