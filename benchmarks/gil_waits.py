"""Where a served call waits for the GIL on a cold start: every call of a stream that could not
start within ``--late-ms`` of when it was due, with what the other threads ran at that moment;
JSON out. A diagnosis, not a comparison (``benchmarks/first_minute.py`` compares).

A call is due when the gap after the last one ends; the thread that serves it sleeps through the
gap and then needs the GIL back. Before each sleep, ``faulthandler``'s watchdog (a C thread that
needs no GIL) is armed to dump every thread's stack ``--late-ms`` after the call is due, and
disarmed as soon as the serving thread runs again: each dump is a moment when some other thread
had held the GIL that long. Per thread not waiting in ``threading`` (the GIL's holder among
them), the innermost frames are kept; the calls are grouped by the innermost frame of tessera's
or torch's code below it (the work that held on). Unlike ``benchmarks/gil_holders.py`` (which
times the background's C calls under a profile hook that slows it), nothing here slows the
background, and a wait that is not one C call (a collection, a compile of generated source) is
seen too.

``python -m benchmarks.gil_waits [--model bert] [--seconds 30] [--late-ms 3]``
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import cold_caches, header

_FRAME = re.compile(r'\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')


def _short(path: str) -> str:
    return re.sub(r"^.*(site-packages/|lib/python3\.\d+/|/(?=tessera/|benchmarks/))", "", path)


def _threads(dump: str, main: int) -> list[list[str]]:
    """Each thread's frames (innermost first) in one dump, but the serving thread's and those
    waiting in ``threading`` (a lock, an event: they hold no GIL)."""
    threads: list[list[str]] = []
    for block in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump):
        head = re.match(r"(?:Current thread|Thread) (0x[0-9a-f]+)", block)
        if head is None or int(head.group(1), 16) == main:
            continue
        frames = [
            f"{_short(m['file'])}:{m['line']} {m['name']}" for m in map(_FRAME.match, block.splitlines()) if m
        ]
        if frames and not frames[0].startswith("threading.py"):
            threads.append(frames)
    return threads


def _where(frames: list[str]) -> str:
    """The innermost frame of tessera's or torch's own code (the work that held the GIL)."""
    return next((f for f in frames if f.startswith(("tessera/", "torch/"))), frames[0])


def run(name: str, seconds: float, late: float, gap: float = 0.02) -> dict[str, Any]:
    import torch

    from benchmarks.first_minute import SIZES, _build

    model, inputs = _build(name)
    sizes = SIZES[name]
    gc.collect()
    import tessera

    model = tessera.compile(model)
    rng = random.Random(0)
    waited: dict[int, float] = {}
    main = threading.get_ident()
    # A named file beside the caches: with an unlinked temporary file, two of three 20 s runs of
    # BERT ended in a segmentation fault (faulthandler reads the other threads without the GIL).
    dump_path = Path(os.environ.get("TESSERA_CACHE_DIR", tempfile.gettempdir())).parent / "gil_waits.txt"
    with open(dump_path, "w+") as dumps, torch.inference_mode():
        start = time.perf_counter()
        call = 0
        while time.perf_counter() - start < seconds:
            model(*inputs(rng.choice(sizes)))
            call += 1
            dumps.write(f"\n=== {call}\n")
            dumps.flush()
            due = time.perf_counter() + gap
            faulthandler.dump_traceback_later(gap + late, file=dumps)
            time.sleep(gap)
            faulthandler.cancel_dump_traceback_later()
            waited[call] = time.perf_counter() - due
        dumps.seek(0)
        text = dumps.read()
    by_place: dict[str, dict[str, Any]] = {}
    for part in text.split("\n=== ")[1:]:
        number, _, dump = part.partition("\n")
        for frames in _threads(dump, main):
            place = by_place.setdefault(_where(frames), {"calls": 0, "longest_wait_ms": 0.0})
            place["calls"] += 1
            wait = round(waited.get(int(number), 0.0) * 1e3, 2)
            if wait >= place["longest_wait_ms"]:
                place["longest_wait_ms"], place["stack"] = wait, frames[:8]
    ranked = sorted(by_place.items(), key=lambda item: (-item[1]["calls"], -item[1]["longest_wait_ms"]))
    waits = sorted(waited.values())
    return {
        "model": name,
        "seconds": seconds,
        "late_ms": late * 1e3,
        "calls": len(waits),
        "calls_waiting_over_late_ms": sum(w > late for w in waits),
        "longest_wait_ms": round(waits[-1] * 1e3, 2) if waits else None,
        "held_by": dict(ranked[:25]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    parser.add_argument("--late-ms", type=float, default=3.0, help="a wait this long is dumped")
    args = parser.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with cold_caches():  # a cold start: caches of its own
        result = run(args.model, args.seconds, args.late_ms / 1e3)
    print(json.dumps({**header("gil_waits"), **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
