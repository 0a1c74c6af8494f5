"""What holds the GIL in tessera's background threads for long: the C calls (which pacing cannot
interrupt) of the trace and the compile threads, over a cold start under a stream of calls; JSON
out. A diagnosis, not a comparison: the profile hook slows the background threads, not the calls.

Every thread started after the hook is set (the trace, the background compile) reports each C
call it makes; calls of ``--min-ms`` or more are kept, except those that wait with the GIL
released (lock waits, reads, sleeps). Per C function: how many, the longest, the total, and the
Python function that called the longest. A C call that calls back into Python (``all`` over a
generator) is listed too, though pacing can stop it there; and with ``PYTHONDONTWRITEBYTECODE``
set, modules whose bytecode is stale are compiled from source at import (``builtins.compile``
called from importlib), which an installed package does not do. ``in_served_calls``: the kept C
calls that overlapped a served call, with the second of the stream and the overlap (the longest
a call could have waited on them; one that calls back into Python may have waited there instead).

``python -m benchmarks.gil_holders [--model bert] [--seconds 30] [--threads 1]``
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import threading
import time
from typing import Any

from benchmarks import cold_caches, header

# C calls that wait with the GIL released: long, but they hold nothing a served call needs.
RELEASING = {
    "acquire",
    "get",
    "read",
    "readinto",
    "sleep",
    "poll",
    "select",
    "wait",
    "waitpid",
    "recv",
    "fsync",
}


def run(name: str, seconds: float, min_seconds: float) -> dict[str, Any]:
    import torch

    from benchmarks.first_minute import SIZES, _build

    held: list[tuple[str, float, str]] = []  # (C function, seconds, its Python caller)
    spans: list[tuple[float, float, str, str]] = []  # the same, as (start, end, function, caller)
    served: list[tuple[float, float]] = []  # the served calls' (start, end)
    started: dict[int, tuple[float, Any, str]] = {}

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            code = frame.f_code
            caller = f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_name}"
            started[threading.get_ident()] = (time.perf_counter(), arg, caller)
        elif event in ("c_return", "c_exception"):
            begun = started.pop(threading.get_ident(), None)
            if begun is None:
                return
            took = time.perf_counter() - begun[0]
            function = getattr(begun[1], "__qualname__", str(begun[1]))
            if took >= min_seconds and function.rsplit(".", 1)[-1] not in RELEASING:
                module = getattr(begun[1], "__module__", None) or ""
                held.append((f"{module}.{function}".lstrip("."), took, begun[2]))
                spans.append((begun[0], begun[0] + took, f"{module}.{function}".lstrip("."), begun[2]))

    model, inputs = _build(name)
    sizes = SIZES[name]
    gc.collect()
    import tessera

    threading.setprofile(hook)  # the threads tessera starts from here on; not this one
    model = tessera.compile(model)
    rng = random.Random(0)
    with torch.inference_mode():
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            args = inputs(rng.choice(sizes))
            began = time.perf_counter()
            model(*args)
            served.append((began, time.perf_counter()))
            time.sleep(0.02)
    threading.setprofile(None)  # type: ignore[arg-type]
    by_function: dict[str, dict[str, Any]] = {}
    for function, took, caller in held:
        seen = by_function.setdefault(function, {"calls": 0, "longest_ms": 0.0, "total_ms": 0.0})
        seen["calls"] += 1
        seen["total_ms"] = round(seen["total_ms"] + took * 1e3, 2)
        if took * 1e3 > seen["longest_ms"]:
            seen["longest_ms"], seen["longest_called_from"] = round(took * 1e3, 2), caller
    ranked = sorted(by_function.items(), key=lambda item: -item[1]["longest_ms"])
    # The holds that overlapped a served call (the call may have waited for the GIL that long):
    # [second of the stream, ms of overlap, function, caller], the longest first.
    overlaps: list[tuple[float, float, str, str]] = []
    for begin, end, function, caller in spans:
        for call_start, call_end in served:
            overlap = min(end, call_end) - max(begin, call_start)
            if overlap > 0:
                overlaps.append((round(call_start - start, 3), round(overlap * 1e3, 2), function, caller))
    overlaps.sort(key=lambda item: -item[1])
    return {"model": name, "seconds": seconds, "held": dict(ranked[:25]), "in_served_calls": overlaps[:20]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    parser.add_argument("--min-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with cold_caches():  # a cold start: caches of its own
        result = run(args.model, args.seconds, args.min_ms / 1e3)
    print(json.dumps({**header("gil_holders"), **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
