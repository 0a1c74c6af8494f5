"""Subprocess helper: sizes learnt from traffic (compile_sizes="auto"), as a service calls.

Usage: python -m tests.run_auto_sizes BACKEND TRAFFIC [HTML]
BACKEND: eager or inductor. TRAFFIC: "skewed" (a few hot sizes among many cold ones), "moved" (the
same with one more hot size: what a warm process learns on top) or "none" (one call of a cold
size); "shapes", "shapes-moved" and "shapes-none" the same for a tiny BERT (and "shapes-listed":
the skewed traffic with its hot shapes listed in compile_sizes, not learnt) whose calls vary in
batch and length (hot shapes among cold ones). The model is the toy Llama (one layer on Inductor)
or the BERT, parameters frozen, called in PyTorch's default state (grad enabled) from four
threads; every output is compared with eager's in the calling thread (an exception fails the
process). HTML: write the
model's report there as a picture. Prints JSON: the sizes learnt, the counters, the artifacts
obtained by size, and the first call's report kind.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import threading
import warnings
from typing import Any

import torch

import tessera
from tessera.models import toy_llama

HOT = (1, 4, 6)  # the sizes the skewed traffic is made of, mostly
HOT_SHAPES = ((2, 16), (4, 8))  # (batch, length): what the BERT's skewed traffic is made of, mostly
MOVED = 9  # the hot size (or shape) the "moved" traffic adds
MOVED_SHAPE = (3, 6)
THREADS = 4
CALLS = 100  # per thread
LISTED_CALLS = 12  # per thread, with the shapes listed: nothing is learnt from them


def model_for(backend: str) -> torch.nn.Module:
    """The toy Llama, parameters frozen (build's): one layer on Inductor (each compile counts)."""
    layers = 1 if backend == "inductor" else 2
    return toy_llama.build(num_layers=layers, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=64)


def bert() -> torch.nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    return transformers.BertModel(config).eval().requires_grad_(False)


def inputs(size: Any, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    if isinstance(size, tuple):  # (batch, length)
        return (torch.randint(0, 64, size, generator=generator),)
    return (torch.randint(0, 64, (size,), generator=generator), torch.arange(size))


def hot(shapes: bool, moved: bool) -> tuple[Any, ...]:
    if shapes:
        return (*HOT_SHAPES, MOVED_SHAPE) if moved else HOT_SHAPES
    return (*HOT, MOVED) if moved else HOT


def traffic(seed: int, calls: int, shapes: bool, moved: bool = False) -> list[Any]:
    """Mostly the hot sizes or shapes (about 25% or 37% each), the rest spread out."""
    rng = random.Random(seed)
    if shapes:
        cold = [(rng.randint(1, 5), rng.randint(3, 24)) for _ in range(calls)]
        return [rng.choice(hot(shapes, moved)) if rng.random() < 0.75 else c for c in cold]
    return [
        rng.choice(hot(shapes, moved)) if rng.random() < 0.75 else rng.randint(2, 40) for _ in range(calls)
    ]


def same(out: Any, expected: Any) -> None:
    if hasattr(out, "last_hidden_state"):
        out, expected = out.last_hidden_state, expected.last_hidden_state
    torch.testing.assert_close(out, expected)


def main() -> None:
    # Every warning the process gives (a CacheWarning, ours), for the test to read.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = run()
    report["warnings"] = sorted(
        {
            f"{w.category.__name__}: {w.message}"
            for w in caught
            if not issubclass(w.category, DeprecationWarning)
        }
    )
    print(json.dumps(report))  # noqa: T201  (the helper's report to the test)


def run() -> dict[str, Any]:
    backend, kind = sys.argv[1], sys.argv[2]
    html = sys.argv[3] if len(sys.argv) > 3 else None
    shapes, moved = kind.startswith("shapes"), kind.endswith("moved")
    model = bert() if shapes else model_for(backend)
    reference = model
    # "shapes-listed": the hot shapes listed by hand (batch, length), nothing learnt.
    sizes: Any = list(HOT_SHAPES) if kind == "shapes-listed" else "auto"
    compiled = tessera.compile(model, backend=backend, compile_sizes=sizes, prefix="auto")
    errors: list[BaseException] = []

    def serve(thread: int) -> None:
        calls = 1 if kind.endswith("none") else LISTED_CALLS if kind.endswith("listed") else CALLS
        # AUTO_SIZES_INFERENCE_MODE=1: the calls under torch.inference_mode(), as servers make them.
        state = (
            torch.inference_mode()
            if os.environ.get("AUTO_SIZES_INFERENCE_MODE")
            else contextlib.nullcontext()
        )
        try:
            with state:
                for i, size in enumerate(traffic(thread, calls, shapes, moved)):
                    args = inputs(size, thread * 1000 + i)
                    same(compiled(*args), reference(*args))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    serve(0)  # the first call alone: its report says cold or warm
    # Served eagerly while its trace is made beside it (cold): the traffic after it is the
    # traces' (what sizes are learnt from).
    assert compiled.wait_traced(300), "the first trace was not made in time"
    first_kind = compiled.report.kind
    workers = [threading.Thread(target=serve, args=(t,)) for t in range(1, THREADS + 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    assert compiled.wait_ready(300), "the learnt sizes did not compile in time"
    report = compiled.report
    # After the compiles: each hot size is served by its static artifact now (a warm process: from
    # its first calls).
    for size in hot(shapes, moved):
        args = inputs(size, 7)
        same(compiled(*args), reference(*args))
    if html is not None:
        from tessera.cli.picture import render_html

        with open(html, "w", encoding="utf-8") as f:
            f.write(render_html([compiled.report.as_dict()]))
    served = {label for runner in compiled.runners.values() for label, n in runner.served() if n}
    return {
        "first_kind": first_kind,
        "learnt": [list(s) if isinstance(s, tuple) else s for s in report.learnt_sizes],
        "counters": tessera.counters.snapshot(),
        "obtained": sorted({(a.size, a.source) for a in report.artifacts}),
        "served_by": sorted(served),
        "files": sorted({a.file for a in compiled.report.artifacts if a.file}),
        # The artifacts a compile worker compiled (the rest: compiled here, loaded or shared).
        "by_worker": sorted({a.size for a in report.artifacts if a.worker is not None}),
    }


if __name__ == "__main__":
    main()
