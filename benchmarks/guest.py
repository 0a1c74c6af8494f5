"""tessera as a guest in the user's process, on its defaults, cold (empty caches); JSON out.

Per run, fresh processes for each of:

- ``first_output``: process start to the first output of the width-256 toy Llama (23 tokens),
  tessera against eager, and ``script_s``: the whole one-call script's run time, exit included;
- ``ready_s``: process start to every size ready (``compile_sizes=[1, 16]``), ``idle`` (one call,
  then waiting), ``gapless`` (calls back to back) and ``gap20ms`` (a call every 20 ms);
- ``user_calls``: under the gapless and the 20 ms streams, the user's own eager model (another
  instance) called after each of tessera's calls, timed: its p50 and p99 over the first
  ``--seconds`` against the same loop in a process with no tessera model (two eager models);
- ``rng_equal``: whether the user's ``torch.multinomial`` and ``torch.rand`` draws between calls
  equal eager's, from the first call until every size is ready; ``state_kept``: whether the
  switch interval, the collector's settings, the thread count and the calling thread's priority
  are as they were after ``wait_ready()``.

Runs are interleaved so that drift on the machine falls on all alike; each figure is given as its
median, min and max over ``--repeats``.

``python -m benchmarks.guest [--layers 4] [--repeats 5] [--seconds 60] [--priority low]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from benchmarks import as_installed, child_env, header
from benchmarks.startup import TOY_WIDTH

START = time.perf_counter()  # as close to process start as a script gets
TOKENS = 23
SIZES = (5, 16, 23, 1)


def _state() -> list[Any]:
    import torch

    return [
        sys.getswitchinterval(),
        gc.isenabled(),
        list(gc.get_threshold()),
        gc.get_freeze_count(),
        torch.get_num_threads(),
        os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
        os.sched_getscheduler(0),
    ]


def child(kind: str, impl: str, layers: int, seconds: float) -> dict[str, Any]:
    """One measured process: ``kind`` is first, idle, gapless or gap20ms."""
    import torch

    from tessera.models import toy_llama

    before = _state()
    model = toy_llama.build(num_layers=layers, **TOY_WIDTH)
    user = toy_llama.build(num_layers=layers, seed=1, **TOY_WIDTH)  # the user's own model
    if impl == "tessera":
        import tessera

        compiled: Any = tessera.compile(model, compile_sizes=[1, 16])
    else:
        compiled = model
    result: dict[str, Any] = {}
    torch.manual_seed(7)
    draws: list[float] = []
    with torch.no_grad():
        compiled(*toy_llama.example_inputs(TOKENS))
        result["first_output_s"] = time.perf_counter() - START
        if kind == "first":
            return result
        user_ms: list[float] = []
        gap = {"idle": None, "gapless": 0.0, "gap20ms": 0.02}[kind]
        ready_at = None
        n = 0
        while True:
            now = time.perf_counter() - START
            ready = impl != "tessera" or compiled.wait_ready(0)
            if ready and ready_at is None:
                ready_at = now
            if now > seconds and (ready_at is not None or now > 600):
                break
            if gap is None:
                if impl == "tessera":
                    compiled.wait_ready(600)
                ready_at = time.perf_counter() - START
                break
            size = SIZES[n % len(SIZES)]
            args = toy_llama.example_inputs(size)
            logits = compiled(*args)
            start = time.perf_counter()
            user(*args)
            user_ms.append((time.perf_counter() - start) * 1000)
            probs = torch.softmax(logits[-1].double(), -1).round(decimals=2) + 1e-3
            draws.append(int(torch.multinomial(probs, 1)))
            draws.append(float(torch.rand(())))
            n += 1
            if gap:
                time.sleep(gap)
        result.update(
            {
                "ready_s": ready_at,
                "calls": n,
                "user_ms": user_ms,
                "draws": draws,
                "state_kept": _state() == before,
            }
        )
    return result


def _run(kind: str, impl: str, layers: int, seconds: float, priority: str) -> tuple[dict[str, Any], float]:
    with tempfile.TemporaryDirectory() as cache:
        env = child_env(
            TESSERA_CACHE_DIR=os.path.join(cache, "tessera"),
            TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
            TESSERA_BACKGROUND_PRIORITY=priority,
        )
        command = [sys.executable, "-m", "benchmarks.guest", "--child", kind, impl]
        command += ["--layers", str(layers), "--seconds", str(seconds)]
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, check=False)
        took = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{kind} {impl}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), took


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=60.0, help="the streams' length, at least")
    parser.add_argument("--priority", default="low", help="background_priority of the compile workers")
    parser.add_argument("--kinds", default="first,idle,gapless,gap20ms")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.layers, args.seconds)))
        return 0
    as_installed()
    kinds = args.kinds.split(",")
    runs: dict[str, dict[str, list[Any]]] = {k: {"eager": [], "tessera": []} for k in kinds}
    for repeat in range(args.repeats):
        for kind in kinds:
            order = ("eager", "tessera") if repeat % 2 == 0 else ("tessera", "eager")
            for impl in order:
                measured, took = _run(kind, impl, args.layers, args.seconds, args.priority)
                measured["process_s"] = took
                runs[kind][impl].append(measured)
    result: dict[str, Any] = {**header("guest"), "layers": args.layers, "repeats": args.repeats}
    result["priority"], result["seconds"] = args.priority, args.seconds
    if "first" in runs:
        first = runs["first"]
        result["first_output"] = {
            "eager_s": _spread([r["first_output_s"] for r in first["eager"]]),
            "tessera_s": _spread([r["first_output_s"] for r in first["tessera"]]),
            "ratio": _spread(
                [
                    t["first_output_s"] / e["first_output_s"]
                    for t, e in zip(first["tessera"], first["eager"], strict=False)
                ]
            ),
            "script_eager_s": _spread([r["process_s"] for r in first["eager"]]),
            "script_tessera_s": _spread([r["process_s"] for r in first["tessera"]]),
        }
    for kind in kinds:
        if kind == "first":
            continue
        ours, eager = runs[kind]["tessera"], runs[kind]["eager"]
        entry: dict[str, Any] = {"ready_s": _spread([r["ready_s"] for r in ours])}
        entry["state_kept"] = all(r["state_kept"] for r in ours)
        # The i-th call's draws depend on i alone: the common prefix of each pair must be equal.
        entry["rng_equal"] = all(
            t["draws"][: min(len(t["draws"]), len(e["draws"]))]
            == e["draws"][: min(len(t["draws"]), len(e["draws"]))]
            for t, e in zip(ours, eager, strict=False)
        )
        if kind != "idle":
            entry["calls"] = _spread([r["calls"] for r in ours])
            for name, rows in (("tessera", ours), ("no_tessera", eager)):
                entry[f"user_p50_ms_{name}"] = _spread([_pct(r["user_ms"], 0.5) for r in rows])
                entry[f"user_p99_ms_{name}"] = _spread([_pct(r["user_ms"], 0.99) for r in rows])
        result[kind] = entry
    if "idle" in result:
        idle = result["idle"]["ready_s"]["median"]
        for kind in ("gapless", "gap20ms"):
            if kind in result:
                result[kind]["ready_over_idle"] = result[kind]["ready_s"]["median"] / idle
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
