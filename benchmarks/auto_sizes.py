"""Sizes learnt from traffic: mean per-call latency over a skewed traffic trace, and compile time.

``python -m benchmarks.auto_sizes [--quick] [--shares 0.02 0.05 0.1] [--model toy|bert]``. The
4-layer width-256 toy Llama on Inductor serves one trace of calls: decode steps whose batch size
(tokens) is drawn from a Zipf-like distribution over 1..64, and a few prefills of 64, 128 or 200
tokens. Compared, in the same process: eager, stock ``torch.compile(dynamic=True)``, tessera with no
compile sizes, tessera with a good hand-written list (the trace's 8 most frequent sizes: the best
list of 8 a user who knew the traffic could write), and tessera with ``compile_sizes="auto"`` at
each share.

``--model bert``: a tiny BERT (2 layers, width 128) whose calls vary in batch and length: three hot
shapes (1x128, 4x64 and 8x32: 30%, 20% and 15% of the calls) and the rest spread over batch 1..8 and
length 16..128. Its pieces have two dynamic sizes, so what is learnt is shapes; the hand-written
list is the shapes that hold at least 5% of the calls (the three hot ones: what a user who knew the
traffic would list, ``compile_sizes=[(1, 128), (4, 64), (8, 32)]``; more shapes would each hold
under 1% and cost a compile).

Each compiled variant first serves the trace until nothing more compiles (its warm-up: the
learning, for auto); its compile seconds are what it spent tracing and compiling (Inductor's cache
empty per variant). Then the steady state: each distinct size of the trace is timed on every
variant in turn, round after round (the fastest round counts), and a variant's mean per-call
latency over the trace is the sum over sizes of each size's share of the calls times its latency
there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

import tessera
from benchmarks import header
from tessera.cli.timing import per_call_seconds
from tessera.models import toy_llama

MODEL: dict[str, Any] = {
    "num_layers": 4,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_heads": 8,
    "num_kv_heads": 4,
}
PREFILLS = (64, 128, 200)
PREFILL_SHARE = 0.06
ZIPF = 1.2  # decode batch b drawn with weight 1 / b**ZIPF
HAND_LIST = 8
HAND_SHARE = 0.05  # the BERT hand list: the shapes with at least this share of the calls


BERT: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
BERT_HOT = {(1, 128): 0.30, (4, 64): 0.20, (8, 32): 0.15}


def bert_traffic(calls: int, seed: int = 0) -> list[tuple[int, int]]:
    """The BERT trace: (batch, length) per call, in call order."""
    rng = random.Random(seed)
    hot = list(BERT_HOT)
    out = []
    for _ in range(calls):
        r, edge = rng.random(), 0.0
        pick = None
        for shape in hot:
            edge += BERT_HOT[shape]
            if r < edge:
                pick = shape
                break
        out.append(pick or (rng.randint(1, 8), 8 * rng.randint(2, 16)))
    return out


def traffic(calls: int, seed: int = 0) -> list[int]:
    """The trace: token counts, in call order."""
    rng = random.Random(seed)
    batches = list(range(1, 65))
    weights = [1 / b**ZIPF for b in batches]
    return [
        rng.choice(PREFILLS) if rng.random() < PREFILL_SHARE else rng.choices(batches, weights)[0]
        for _ in range(calls)
    ]


@contextlib.contextmanager
def empty_inductor_cache() -> Iterator[None]:
    """An empty Inductor cache for one variant's compiles (Inductor reads the variable at each
    cache access, background threads included: kept until the variant is ready)."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="tessera-auto-") as scratch:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch
        try:
            yield
        finally:
            if previous is None:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def serve(fn: Callable[..., Any], trace: list[Any], inputs: dict[Any, tuple[Any, ...]]) -> float:
    """Serve the trace once; the mean seconds per call."""
    with torch.no_grad():
        start = time.perf_counter()
        for n in trace:
            fn(*inputs[n])
        return (time.perf_counter() - start) / len(trace)


def warm_up(name: str, make: Callable[[], Any], trace: list[Any], inputs: dict[Any, Any]) -> dict[str, Any]:
    """Compile a variant and serve the trace until it compiles nothing more (at most 6 passes)."""
    with empty_inductor_cache():
        start = time.perf_counter()
        fn = make()
        with torch.no_grad():
            fn(*inputs[trace[0]])
        first = time.perf_counter() - start
        if isinstance(fn, tessera.CompiledModel):
            fn.wait_ready()  # listed sizes compile now, with nothing else running
        passes = 0
        learnt: tuple[Any, ...] = ()
        for passes in range(1, 7):
            serve(fn, trace, inputs)
            if isinstance(fn, tessera.CompiledModel):
                fn.wait_ready()
                now = fn.report.learnt_sizes if fn.report is not None else ()
                if now == learnt and passes > 1:
                    break
                learnt = now
            else:
                break
        wall = time.perf_counter() - start
    row: dict[str, Any] = {"variant": name, "first_output_seconds": first, "warm_up_passes": passes}
    if isinstance(fn, tessera.CompiledModel):
        report = fn.report
        assert report is not None
        compiled = [a for a in report.artifacts if a.source == "compiled"]
        row["compile_seconds"] = report.phase("trace") + sum(a.seconds for a in compiled)
        row["artifacts_compiled"] = len(compiled)
        row["static_sizes"] = sorted({int(a.size.split()[1]) for a in compiled if a.size.startswith("size")})
        row["static_shapes"] = sorted({a.size.split()[1] for a in compiled if a.size.startswith("shape")})
        row["learnt_sizes"] = [list(s) if isinstance(s, tuple) else s for s in report.learnt_sizes]
    else:
        row["compile_seconds"] = first if name.startswith("stock") else 0.0
    row["warm_up_wall_seconds"] = wall
    row["fn"] = fn
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="a trace of 200 calls and 3 rounds (not 400 and 7)"
    )
    parser.add_argument("--shares", nargs="*", type=float, default=[0.02, 0.05, 0.1])
    parser.add_argument("--model", choices=["toy", "bert"], default="toy")
    args = parser.parse_args(argv)
    calls, rounds = (200, 3) if args.quick else (400, 7)
    torch.manual_seed(0)
    bert = args.model == "bert"
    trace: list[Any] = bert_traffic(calls) if bert else traffic(calls)
    counts = Counter(trace)
    if bert:
        hand: list[Any] = sorted(s for s, c in counts.items() if c / calls >= HAND_SHARE)
    else:
        hand = sorted(n for n, _ in counts.most_common(HAND_LIST))
    if bert:
        import transformers

        config: Any = transformers.BertConfig(**BERT, intermediate_size=256)
        model: Any = transformers.BertModel(config)
        model.eval().requires_grad_(False)
        generator = torch.Generator().manual_seed(0)
        inputs: dict[Any, tuple[Any, ...]] = {
            s: (torch.randint(0, BERT["vocab_size"], s, generator=generator),) for s in counts
        }
    else:
        model = toy_llama.build(**MODEL)
        inputs = {n: toy_llama.example_inputs(n) for n in counts}
    cache = tempfile.mkdtemp(prefix="tessera-auto-cache-")

    def ours(name: str, **options: Any) -> Callable[[], Any]:
        root = os.path.join(cache, name.replace(" ", "_"))
        prefix = args.model
        return lambda: tessera.compile(model, backend="inductor", cache_dir=root, prefix=prefix, **options)

    variants: list[tuple[str, Callable[[], Any]]] = [
        ("eager", lambda: model),
        ("stock torch.compile (dynamic)", lambda: torch.compile(model, backend="inductor", dynamic=True)),
        ("tessera, no sizes", ours("none")),
        (f"tessera, hand-written list {[_name(n) for n in hand]}", ours("hand", compile_sizes=hand)),
        *[
            (f"tessera, auto (share {s})", ours(f"auto{s}", compile_sizes="auto", auto_sizes_share=s))
            for s in args.shares
        ],
    ]
    rows = []
    for name, make in variants:
        rows.append(warm_up(name, make, trace, inputs))
        print(f"{name}: ready", file=sys.stderr)
    # The trace's mean latency is the sum over its sizes of (share x that size's latency); each
    # size is timed on every variant in turn, round after round, and its latency is the fastest
    # round: what the code costs when the machine lets it run. Whole passes over the trace, timed
    # one variant after another, differed by 30% between rounds on the 2-core machine, and so did
    # medians; the minimum of a size's rounds repeated within a few percent.
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for n in sorted(counts):
            for row in rows:
                seconds = per_call_seconds(row["fn"], *inputs[n], warmup=1, repeats=3, inner=4)
                samples.setdefault((row["variant"], n), []).append(seconds)
    for row in rows:
        row.pop("fn")
        latency = {n: min(samples[(row["variant"], n)]) for n in counts}
        row["mean_ms_per_call"] = sum(latency[n] * c for n, c in counts.items()) / calls * 1e3
        row["ms_at_top_sizes"] = {_name(n): latency[n] * 1e3 for n, _ in counts.most_common(8)}
    eager = rows[0]["mean_ms_per_call"]
    best_list = next((r["mean_ms_per_call"] for r in rows if r["variant"].startswith("tessera, hand")), None)
    no_sizes = next(r["mean_ms_per_call"] for r in rows if r["variant"] == "tessera, no sizes")
    for row in rows:
        row["over_eager"] = row["mean_ms_per_call"] / eager
        if best_list is not None:
            row["over_hand_list"] = row["mean_ms_per_call"] / best_list
        row["over_no_sizes"] = row["mean_ms_per_call"] / no_sizes
    traffic_record: dict[str, Any] = {
        "calls": calls,
        "rounds": rounds,
        "distinct_sizes": len(counts),
        "top_sizes": [[_name(n), c / calls] for n, c in counts.most_common(12)],
    }
    if not bert:
        traffic_record["prefill_share"] = sum(counts[p] for p in PREFILLS) / calls
    result = {
        **header("auto_sizes"),
        "model": {"bert": {**BERT, "intermediate_size": 256}} if bert else MODEL,
        "traffic": traffic_record,
        "variants": rows,
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


def _name(size: Any) -> Any:
    """A size as the JSON names it: itself, or ``"4x64"`` for a (batch, length) shape."""
    return "x".join(map(str, size)) if isinstance(size, tuple) else size


if __name__ == "__main__":
    raise SystemExit(main())
