"""What dropping a compiled model costs a service that swaps models: JSON out.

A service that replaces a model (a new version, a model no longer asked for) drops its reference
and expects the memory back at once, without stalling what it still serves. Per implementation, a
fresh process with empty caches builds the toy Llama, compiles it (tessera: its defaults, Inductor
with the background compile, which freezes the heap once it ends, heap.py; stock ``torch.compile``;
eager: no compile), serves a call at each of a few sizes, waits for every background thread, then
drops the model (``del``). Printed per implementation:

- ``drop_s``: how long the ``del`` took (tessera walks the frozen heap once there: ``HEAP.dropped``);
- ``freed``: whether the model's weights were gone right after the ``del``, with no
  ``gc.collect()``; ``freed_after_collect``: after one;
- ``longest_pause_s``: the longest another thread of the process waited for the GIL while the
  ``del`` ran (a thread that wakes every millisecond): what a call served beside it would wait;
- ``frozen_objects``: the objects in the permanent generation before the drop (tessera's freeze).

``python -m benchmarks.drop_cost [--layers 4] [--impls eager,tessera,torch.compile]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any

from benchmarks import child_env, header

IMPLS = ("eager", "tessera", "torch.compile")
SIZES = (16, 24, 32)


class _Watcher:
    """A thread that wakes every millisecond and keeps the longest gap between two wakes while
    ``watching``: the GIL held by another thread for that long."""

    def __init__(self) -> None:
        self.watching = False
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drop-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(0.001):
            now = time.perf_counter()
            if self.watching:
                self.longest = max(self.longest, now - last)
            last = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def child(impl: str, layers: int) -> dict[str, Any]:
    import torch

    from tessera.models import toy_llama

    torch.manual_seed(0)
    model: Any = toy_llama.build(
        num_layers=layers, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4
    )
    weights = weakref.ref(next(model.parameters()))
    if impl == "tessera":
        import tessera

        model = tessera.compile(model, background_compile=True)  # the default, whatever the environment
    elif impl == "torch.compile":
        model = torch.compile(model)
    for size in SIZES:
        model(*toy_llama.example_inputs(size))
    if impl == "tessera":
        model.wait_ready()
    # tessera's background threads (trace, compile, learning) end after the compiles land, and the
    # heap freezes as the last one ends. (Not every thread: thread pools idle for good.)
    for thread in threading.enumerate():
        if thread.name.startswith("tessera-") and not thread.daemon:  # not the worker pool's feeders
            thread.join()
    frozen = gc.get_freeze_count()
    watcher = _Watcher()
    time.sleep(0.05)
    watcher.watching = True
    start = time.perf_counter()
    del model
    drop = time.perf_counter() - start
    time.sleep(0.01)  # the watcher's wake after the drop, which ends the gap it measures
    watcher.watching = False
    watcher.stop()
    freed = weights() is None
    gc.collect()
    return {
        "impl": impl,
        "drop_s": round(drop, 4),
        "freed": freed,
        "freed_after_collect": weights() is None,
        "longest_pause_s": round(watcher.longest, 4),
        "frozen_objects": frozen,
    }


def _run(impl: str, layers: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        env = child_env(
            TESSERA_CACHE_DIR=os.path.join(cache, "tessera"),
            TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
        )
        command = [sys.executable, "-m", "benchmarks.drop_cost", "--child", impl, "--layers", str(layers)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode:
            raise RuntimeError(f"{impl} failed:\n{done.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--child", choices=IMPLS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers)), flush=True)
        return
    results = {impl: _run(impl, args.layers) for impl in args.impls.split(",")}
    print(json.dumps({**header("drop_cost"), "layers": args.layers, "results": results}, indent=2))


if __name__ == "__main__":
    main()
