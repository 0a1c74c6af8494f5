"""Where a paced background thread runs long without an event its trace function sees: the gaps
between the events of tessera's paced threads (the trace, the compiles), over a cold start with
eager first; JSON out. A diagnosis, not a comparison.

Pacing gives way at the events of a trace function ('call', and lines inside the functions of
``tessera._compat.LONG_RUNNING``). Code that runs for milliseconds without one holds the GIL beside
a served call for all that time: a loop with no Python call in it (then its function belongs in
``LONG_RUNNING``), or one C call (``exec``, ``marshal``, ``compile``: no trace function can split
it; ``benchmarks/gil_holders.py`` names those). Each gap of ``--min-ms`` or more is listed with the
function of the last event before it (where the time went, or its caller) and the stack of the
event after it. A gap is the thread's own CPU time between two events (a wait for a lock or a
worker's reply costs none, and holds no GIL). No call is served meanwhile, so the gaps are the
background's alone; the timing wrapper slows the background, not its gaps' code.

``python -m benchmarks.trace_gaps [--model bert] [--min-ms 1] [--threads 1]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from benchmarks import as_installed, cold_caches, header


def _where(frame: Any) -> str:
    code = frame.f_code
    return f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_name}:{frame.f_lineno}"


def run(name: str, min_seconds: float) -> dict[str, Any]:
    import torch

    from benchmarks.first_minute import SIZES, _build
    from tessera import pacing

    gaps: list[tuple[float, str, list[str]]] = []  # (seconds, the last event's function, stack after)
    paced = pacing.Pacer.paced

    @contextlib.contextmanager
    def timed(self: pacing.Pacer, counted: bool = False) -> Iterator[None]:
        with paced(self, counted):
            hook = sys.gettrace()  # pacing's own, set by the line above
            last: list[Any] = [time.thread_time(), "the thread's start"]

            def seen(frame: Any) -> None:
                now = time.thread_time()
                if now - last[0] >= min_seconds:
                    stack: list[str] = []
                    f = frame
                    while f is not None and len(stack) < 5:
                        stack.append(_where(f))
                        f = f.f_back
                    gaps.append((now - last[0], last[1], stack))
                last[1] = _where(frame)

            def local(inner: Any) -> Any:
                def on_line(frame: Any, event: Any, arg: Any) -> Any:
                    seen(frame)
                    inner(frame, event, arg)
                    last[0] = time.thread_time()
                    return on_line

                return on_line

            def on_call(frame: Any, event: Any, arg: Any) -> Any:
                seen(frame)
                inner = hook(frame, event, arg) if hook is not None else None
                last[0] = time.thread_time()
                return None if inner is None else local(inner)

            sys.settrace(on_call)
            try:
                yield
            finally:
                sys.settrace(hook)

    model, inputs = _build(name)
    gc.collect()
    import tessera

    pacing.Pacer.paced = timed  # type: ignore[method-assign]
    try:
        compiled = tessera.compile(model, eager_first=True, background_compile=True)
        with torch.inference_mode():
            compiled(*inputs(SIZES[name][0]))
            compiled.wait_ready(600)
    finally:
        pacing.Pacer.paced = paced  # type: ignore[method-assign]
    ranked = sorted(gaps, key=lambda gap: -gap[0])
    return {
        "model": name,
        "gaps": len(gaps),
        "gaps_ms": round(sum(g[0] for g in gaps) * 1e3, 1),
        "longest": [
            {"ms": round(took * 1e3, 2), "after": after, "next_event_stack": stack}
            for took, after, stack in ranked[:25]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    parser.add_argument("--min-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    as_installed()  # tessera's modules imported from bytecode, not compiled from source in a gap
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with cold_caches():  # a cold start: caches of its own
        result = run(args.model, args.min_ms / 1e3)
    print(json.dumps({**header("trace_gaps"), **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
