"""Subprocess helper for tests/test_guest.py: tessera on its defaults beside the user's own code.

Usage: python -m tests.run_guest SCENARIO [--impl tessera|eager] [--calls N]

Each scenario prints one JSON line. The model is the tiny toy Llama with ``compile_sizes=[8]``, so
that a background compile runs beside the user's code; nothing else is set (Inductor, background
compile and compile workers are the defaults).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tessera.models import toy_llama

SIZES = (3, 8, 13)
GAP = 0.003  # seconds between a sampling loop's calls


def _model(impl: str) -> tuple[torch.nn.Module, Any]:
    model = toy_llama.build(num_layers=1)
    if impl == "eager":
        return model, model
    import tessera

    return model, tessera.compile(model, compile_sizes=[8])


def _ready(compiled: Any) -> bool:
    wait = getattr(compiled, "wait_ready", None)
    return True if wait is None else bool(wait(0))


def _stopped_children() -> int:
    """How many of this process's compile workers are stopped now (Linux's /proc)."""
    mine, stopped = str(os.getpid()), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == mine and fields[0] in ("T", "t"):
            stopped += 1
    return stopped


def _process_state() -> dict[str, Any]:
    return {
        "switch_interval": sys.getswitchinterval(),
        "gc_enabled": gc.isenabled(),
        "gc_threshold": list(gc.get_threshold()),
        "gc_freeze_count": gc.get_freeze_count(),
        "num_threads": torch.get_num_threads(),
        "default_dtype": str(torch.get_default_dtype()),
        "nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
        "policy": os.sched_getscheduler(0),
        "trace": repr(sys.gettrace()),
        "threading_trace": repr(threading.gettrace()),
    }


def _user_tracer(frame: Any, event: str, arg: Any) -> None:
    return None


def sampling(impl: str, calls: int) -> dict[str, Any]:
    """The user's own sampling between calls: ``calls`` calls (0: until every size is compiled,
    then 20 more), each followed by a multinomial over the logits and a ``torch.rand``."""
    threading.settrace(_user_tracer)  # a tracer of the user's (coverage, a debugger)
    sys.settrace(_user_tracer)
    before = _process_state()
    model, compiled = _model(impl)
    torch.manual_seed(1234)
    draws: list[float] = []  # the global stream: a torch.rand after each multinomial
    picks: list[int] = []  # what the multinomial picked: it reads the model's output
    stopped = 0
    n = 0
    extra = 20
    with torch.enable_grad():  # PyTorch's default state: the model is frozen
        while (calls and n < calls) or (not calls and extra > 0):
            size = SIZES[n % len(SIZES)]
            logits = compiled(*toy_llama.example_inputs(size))
            # The stream of random numbers a multinomial consumes does not depend on the
            # probabilities, so the rand after it is eager's whatever the logits' last bits; the
            # pick reads them (rounded, a kernel's last bit moves it only at a rounding boundary).
            probs = torch.softmax(logits[-1].double(), -1).round(decimals=2) + 1e-3
            picks.append(int(torch.multinomial(probs, 1)))
            draws.append(float(torch.rand(())))
            n += 1
            time.sleep(GAP)  # a service's requests come with gaps between them
            if n % 25 == 0:
                stopped += _stopped_children()
            if not calls and _ready(compiled):
                extra -= 1
        ready = compiled.wait_ready(600) if impl == "tessera" else True
        outputs = {s: compiled(*toy_llama.example_inputs(s)) for s in (5, 8, 21)}
        for s, out in outputs.items():
            torch.testing.assert_close(out, model(*toy_llama.example_inputs(s)), msg=f"size {s}")
    after = _process_state()
    sys.settrace(None)
    threading.settrace(None)  # type: ignore[arg-type]
    counts = {}
    if impl == "tessera":
        import tessera

        counts = tessera.counters.snapshot()
    return {
        "calls": n,
        "draws": draws,
        "picks": picks,
        "rng_state": torch.get_rng_state().tolist()[-32:],
        "ready": ready,
        "before": before,
        "after": after,
        "stopped_samples": stopped,
        "counters": counts,
    }


def imports(impl: str, calls: int) -> dict[str, Any]:
    """The user's own imports of torch._inductor and _dynamo, and a torch.compile of their own, at
    moments after the first call (while the trace's compiles run)."""
    model, compiled = _model(impl)
    errors: list[str] = []
    marks = (0.0, 0.1, 0.3, 0.6, 1.2)
    with torch.no_grad():
        compiled(*toy_llama.example_inputs(5))
        start = time.monotonic()
        for i, mark in enumerate(marks):
            while time.monotonic() - start < mark:
                compiled(*toy_llama.example_inputs(SIZES[i % 3]))
            try:
                if i == 0:
                    importlib.import_module("torch._inductor.config")
                    importlib.import_module("torch._inductor.utils")
                elif i == 1:
                    importlib.import_module("torch._dynamo.utils")
                elif i == 2:
                    torch.use_deterministic_algorithms(False)
                else:
                    own = torch.compile(lambda x, k=i: (x * 2).sin() + k, dynamic=True)
                    torch.testing.assert_close(own(torch.ones(4 + i)), (torch.ones(4 + i) * 2).sin() + i)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
        ready = compiled.wait_ready(600)
        for s in (5, 8, 21):
            torch.testing.assert_close(
                compiled(*toy_llama.example_inputs(s)), model(*toy_llama.example_inputs(s))
            )
    import tessera

    return {"errors": errors, "ready": ready, "counters": tessera.counters.snapshot()}


def bad_calls(impl: str, calls: int) -> dict[str, Any]:
    """Calls eager rejects, made from another thread while the first trace is made; then a call
    that needs a trace of its own (float64 weights)."""
    import tessera

    model, compiled = _model(impl)
    ids, pos = toy_llama.example_inputs(9)
    seen: list[str] = []
    started = threading.Event()

    def bad() -> None:
        started.set()
        for _ in range(3):
            for call in ((ids.float(), pos), (ids,)):
                try:
                    compiled(*call)
                    seen.append("no error")
                except Exception as e:
                    seen.append(type(e).__name__ if not isinstance(e, TypeError) else "TypeError")

    eager_seen = []
    for call in ((ids.float(), pos), (ids,)):
        try:
            model(*call)
        except Exception as e:
            eager_seen.append(type(e).__name__)
    with torch.no_grad():
        thread = threading.Thread(target=bad)
        thread.start()
        started.wait()
        first = compiled(ids, pos)
        thread.join()
        torch.testing.assert_close(first, model(ids, pos))
        assert compiled.wait_ready(600)
        before = tessera.counters.snapshot()
        model.double()
        for s in (5, 8, 21):
            torch.testing.assert_close(
                compiled(*toy_llama.example_inputs(s)), model(*toy_llama.example_inputs(s))
            )
        ready = compiled.wait_ready(600)
        for s in (5, 8, 21):
            torch.testing.assert_close(
                compiled(*toy_llama.example_inputs(s)), model(*toy_llama.example_inputs(s))
            )
        after = tessera.counters.snapshot()
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    return {
        "seen": seen,
        "eager": eager_seen * 3,
        "ready": ready,
        "delta": delta,
        "traces": len(compiled.traces),
    }


def once(impl: str, calls: int) -> dict[str, Any]:
    """One call and an exit (the exit's time is the caller's to measure); prints as soon as the
    call has answered, so that a signal can be sent then."""
    import signal

    # As a terminal's Ctrl-C finds a script: a parent that ignores SIGINT (pytest-xdist's workers)
    # passes that on, and Python then raises no KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _, compiled = _model(impl)
    with torch.no_grad():
        compiled(*toy_llama.example_inputs(23))
    print(json.dumps({"answered": True}), flush=True)  # noqa: T201  (the helper's report to the test)
    if calls:  # then serve until a signal comes (Ctrl-C: the script's own way out)
        try:
            with torch.no_grad():
                while True:
                    compiled(*toy_llama.example_inputs(SIZES[0]))
                    time.sleep(GAP)
        except KeyboardInterrupt:
            pass
    return {"answered": True}


SCENARIOS = {"sampling": sampling, "imports": imports, "bad_calls": bad_calls, "once": once}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--impl", default="tessera", choices=("tessera", "eager"))
    parser.add_argument("--calls", type=int, default=0)
    args = parser.parse_args()
    result = SCENARIOS[args.scenario](args.impl, args.calls)
    print(json.dumps(result), flush=True)  # noqa: T201  (the helper's report to the test)
    return 0


if __name__ == "__main__":
    sys.exit(main())
