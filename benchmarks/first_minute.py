"""Eager first: process start to first output, and every call of the first minute after a cold
start, against eager in the same run; JSON out.

Per model, a fresh process for eager and one for tessera with eager first on (an option; otherwise its
defaults: Inductor, background compile, an empty cache and empty Inductor caches); with
``--trace-first``, one more for tessera's defaults (the first call traces, then answers). Each
times process start to first output, then serves a stream of calls (one every ``--gap`` seconds,
sizes drawn from the model's list) for ``--seconds``, recording each call's latency and what
served it; a call's latency runs from when it was due (the end of the last call plus ``--gap``),
so the time a request waits for the GIL before its call starts (a garbage collection, a thread
that holds it) counts. Printed per model:

- ``first_output_ratio``: tessera's process start to first output over eager's (the issue's bar:
  at most 1.1; tessera's bytecode compiled first, as an install does: ``as_installed``), and
  ``first_output_pairs``: the median ratio over ``--first-output-runs`` more pairs of fresh
  processes that stop at the first output (one pair is noisy on a small machine);
- ``worst_call_ratio``: tessera's slowest call of the stream over eager's median call at the same
  size (bar: at most 2);
- ``calls_over_2x``: how many of tessera's calls took more than twice eager's median at their size
  (``calls_over_2x_by_stage``: by what served them, ``eager`` while the trace is made; and
  ``worst_call_stage_and_second``: what served the slowest, and when in the stream);
- ``slow_calls``: each call over 2x, on the process's time axis, with the background step whose
  span covers it and any garbage collection of over a millisecond beside it (which thread ran it);
  ``collections_over_5ms``: those of over 5 ms during the stream, by generation;
- ``p99_call_ratio``: the 99th percentile of tessera's calls, each over eager's median at its size;
- ``eager_worst_call_ratio`` / ``eager_calls_over_2x`` / ``eager_p99_call_ratio``: the same for
  eager's own stream: the machine's noise, the floor the bar is read against;
- ``steady_ratio``: tessera's median call after every compile is in place over eager's median;
- ``seconds_to_traced`` / ``seconds_to_ready``: when the first trace served, when every size had
  compiled; ``traces_landed_s``: when each trace that serves landed, from process start;
- ``max_abs_diff``: tessera's outputs for fixed inputs, after the stream, against eager's.

``python -m benchmarks.first_minute [--models toy4,toy16,bert,vit] [--seconds 60]
[--priorities low,normal] [--threads 1]``
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
import time
from pathlib import Path
from typing import Any

from benchmarks import as_installed, child_env, header

START = time.perf_counter()  # as close to process start as Python lets a script be
MODELS = ("toy4", "toy16", "bert", "vit")


def _build(name: str) -> tuple[Any, Any]:
    """The model, and ``inputs(size)`` giving its call's arguments for one size of the stream."""
    import torch

    torch.manual_seed(0)
    model: Any
    if name.startswith("toy"):
        from tessera.models import toy_llama

        model = toy_llama.build(
            num_layers=int(name[3:]), hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=4
        )
        return model, toy_llama.example_inputs
    import transformers

    small: dict[str, Any] = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    small["intermediate_size"] = 256
    if name == "bert":
        model = transformers.BertModel(transformers.BertConfig(vocab_size=1024, **small))
        model.eval()

        def bert_inputs(n: int) -> tuple[Any, ...]:
            batch, length = divmod(n, 100)
            generator = torch.Generator().manual_seed(n)
            return (torch.randint(0, 1024, (batch, length), generator=generator),)

        return model, bert_inputs
    model = transformers.ViTModel(transformers.ViTConfig(image_size=64, patch_size=16, **small))
    model.eval()
    return model, lambda n: (torch.randn(n, 3, 64, 64, generator=torch.Generator().manual_seed(n)),)


SIZES = {  # the stream's sizes: tokens (toy), batch * 100 + length (bert), batch (vit)
    "toy4": (16, 24, 32, 40),
    "toy16": (16, 24, 32, 40),
    "bert": (108, 116, 132, 208, 216),
    "vit": (1, 2, 4),
}


def _first(output: Any) -> Any:
    return output[0] if isinstance(output, tuple) else getattr(output, "last_hidden_state", output)


def child(name: str, impl: str, seconds: float, gap: float, threads: int = 0) -> dict[str, Any]:
    import random

    import torch

    if threads:
        torch.set_num_threads(threads)
    collections = _record_collections()

    model, inputs = _build(name)
    sizes = SIZES[name]
    first_args = inputs(sizes[0])
    # The heap ``import torch`` leaves is near a full collection (~0.1 s): it would fall on whichever
    # process allocates a few thousand objects first (benchmarks/startup.py). Every process pays
    # it here, before the measured part.
    gc.collect()
    if impl.startswith("tessera"):
        import tessera

        model = tessera.compile(model, eager_first=impl == "tessera")
    with torch.inference_mode():
        _first(model(*first_args))
    first_output = time.perf_counter() - START
    if seconds <= 0:  # the first output alone: out at once, the background compile left unfinished
        print(json.dumps({"first_output": first_output}), flush=True)
        os._exit(0)
    rng = random.Random(0)
    calls: list[dict[str, Any]] = []
    gil: Any = None  # a reader of the thread's GIL waits (none in this version)
    gil_mark = gil() if gil else 0.0
    stream_start = time.perf_counter()
    traced_at = ready_at = None
    with torch.inference_mode():
        size = rng.choice(sizes)
        args = inputs(size)
        stage = getattr(getattr(model, "stage", None), "value", "eager")
        due = time.perf_counter()
        while time.perf_counter() - stream_start < seconds:
            gil_start = gil() if gil else 0.0
            start = time.perf_counter()
            _first(model(*args))
            end = time.perf_counter()
            gil_end = gil() if gil else 0.0
            now = end - stream_start
            # A request waits from when it is due, not from when this thread got the GIL back: a
            # collection or another thread that held the GIL through the sleep delayed it as much.
            late = max(0.0, start - due)
            call = {"at": round(now, 4), "size": size, "seconds": end - start + late, "late": late}
            if gil:  # waits for the GIL since the sleep began: after it (late), and in the call
                call.update(gil_late=gil_start - gil_mark, gil_in=gil_end - gil_start)
            calls.append({**call, "stage": stage})
            if impl != "eager":
                if traced_at is None and stage == "ready":
                    traced_at = now
                if ready_at is None and model.ready:
                    ready_at = now
            # The next call made ready before the gap (its arguments, the stage that will serve
            # it), so that what counts as late is the wait for the GIL alone.
            size = rng.choice(sizes)
            args = inputs(size)
            stage = getattr(getattr(model, "stage", None), "value", "eager")
            due = time.perf_counter() + gap
            gil_mark = gil() if gil else 0.0
            time.sleep(gap)
        steady = []
        if impl != "eager":
            model.wait_ready()
        for size in sizes * 5:
            args = inputs(size)
            start = time.perf_counter()
            _first(model(*args))
            steady.append(time.perf_counter() - start)
        outputs = [_first(model(*inputs(size))).float().clone() for size in sizes]
    # When each trace that serves landed, in seconds from process start (a trace held back is
    # not listed): the report's timeline.
    timeline = getattr(getattr(model, "report", None), "timeline", ())
    landed = {s.what: round(s.end, 2) for s in timeline if s.what.startswith("trace ")}
    spans = [[s.what, s.piece, s.source, round(s.start, 3), round(s.end, 3)] for s in timeline]
    report = getattr(model, "report", None)
    compiled = [a for a in getattr(report, "artifacts", ()) if a.source == "compiled"]
    return {
        # With TESSERA_COMPILE_SIZES=auto: the sizes learnt in the minute; and where each artifact
        # compiled (a compile worker, or this process beside the calls).
        "learnt": [str(s) for s in getattr(report, "learnt_sizes", ())],
        "compiled_here": sum(a.worker is None for a in compiled),
        "compiled_by_worker": sum(a.worker is not None for a in compiled),
        "traces_landed_s": landed,
        "timeline": spans,
        "stream_start": stream_start - START,
        "collections": collections,
        "first_output": first_output,
        "calls": calls,
        "steady_median": statistics.median(steady),
        "seconds_to_traced": traced_at,
        "seconds_to_ready": ready_at,
        "outputs": [o.tolist() for o in outputs],
    }


def _record_collections() -> list[list[Any]]:
    """Every garbage collection of over a millisecond from now on, as [second from process start,
    milliseconds, generation, the thread that ran it]: a collection holds the GIL, so a call
    served beside it waits for all of it."""
    import threading

    collections: list[list[Any]] = []
    started: dict[int, float] = {}

    def on_collection(phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            started[threading.get_ident()] = now
            return
        begun = started.pop(threading.get_ident(), now)
        if now - begun > 1e-3:
            where = threading.current_thread().name
            took_ms = round((now - begun) * 1e3, 1)
            collections.append([round(begun - START, 4), took_ms, info["generation"], where])

    gc.callbacks.append(on_collection)
    return collections


def _run(
    name: str, impl: str, seconds: float, gap: float, priority: str = "low", threads: int = 0
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as cache:
        env = child_env(
            TESSERA_CACHE_DIR=os.path.join(cache, "tessera"),
            TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
            TESSERA_BACKGROUND_PRIORITY=priority,
        )
        command = [sys.executable, "-m", "benchmarks.first_minute", "--child", name, impl]
        command += ["--seconds", str(seconds), "--gap", str(gap), "--threads", str(threads)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode:
            raise RuntimeError(f"{name} {impl} failed:\n{done.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result


def _first_outputs(name: str, runs: int) -> dict[str, Any]:
    """``runs`` pairs of fresh processes, eager's and tessera's (cold, eager first), timed to the
    first output and nothing more: the median of the pairs' ratios, drift on the machine cancelled
    by the pairing."""
    pairs = []
    for run in range(runs):  # the order alternates: neither goes first on a machine warmed by the other
        order = ("eager", "tessera") if run % 2 == 0 else ("tessera", "eager")
        firsts = {impl: _run(name, impl, 0, 0)["first_output"] for impl in order}
        pairs.append((firsts["eager"], firsts["tessera"]))
    return {
        "runs": runs,
        "eager_first_output_s": [round(e, 3) for e, _ in pairs],
        "tessera_first_output_s": [round(t, 3) for _, t in pairs],
        "first_output_ratio_median": round(statistics.median(t / e for e, t in pairs), 3),
    }


def _long_collections(ours: dict[str, Any]) -> dict[str, int]:
    # During the stream only: the walk of the frozen heap when the child drops its model at the
    # end (heap.py) is not a served call's.
    offset = ours.get("stream_start", 0.0)
    end = offset + max((c["at"] for c in ours["calls"]), default=0.0)
    long: dict[str, int] = {}
    for s, ms, gen, _ in ours.get("collections", ()):
        if ms > 5 and offset <= s <= end:
            long[f"gen{gen}"] = long.get(f"gen{gen}", 0) + 1
    return long


CAUSES = ("late_for_the_gil", "late_for_a_core", "gil_in_call", "on_its_core")


def _cause(call: dict[str, Any], median: float) -> str:
    """What most of a slow call's time over eager's median went to (``--gil-clock``)."""
    late_gil = min(call["gil_late"], call["late"])
    ran = call["seconds"] - call["late"] - call["gil_in"] - median
    parts = (late_gil, call["late"] - late_gil, call["gil_in"], ran)
    return CAUSES[max(range(len(parts)), key=parts.__getitem__)]


def _compare(eager: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    import torch

    # Each call against eager's median at its own size: the sizes of a stream differ in cost (a
    # BERT call of 2x16 tokens takes about twice one of 1x8), so one median for the mix would
    # count eager's own large calls as slow.
    by_size: dict[int, list[float]] = {}
    for call in eager["calls"]:
        by_size.setdefault(call["size"], []).append(call["seconds"])
    medians = {size: statistics.median(seconds) for size, seconds in by_size.items()}
    eager_median = statistics.median(c["seconds"] for c in eager["calls"])
    eager_stream = [c["seconds"] / medians[c["size"]] for c in eager["calls"]]
    stream = [c["seconds"] / medians[c["size"]] for c in ours["calls"]]

    def p99(ratios: list[float]) -> float:
        return round(statistics.quantiles(ratios, n=100)[98], 2)

    diffs = [
        float((torch.tensor(a) - torch.tensor(b)).abs().max())
        for a, b in zip(ours["outputs"], eager["outputs"], strict=True)
    ]
    by_stage: dict[str, int] = {}
    over_by_stage: dict[str, int] = {}
    for call, ratio in zip(ours["calls"], stream, strict=True):
        by_stage[call["stage"]] = by_stage.get(call["stage"], 0) + 1
        if ratio > 2:
            over_by_stage[call["stage"]] = over_by_stage.get(call["stage"], 0) + 1
    worst = max(range(len(stream)), key=stream.__getitem__)
    # The slow calls on the process's time axis (the timeline's), with what ran beside them: the
    # background step (trace, compile, load) whose span covers the call, if any.
    offset = ours.get("stream_start", 0.0)
    slow: list[list[Any]] = []
    clocked = bool(ours["calls"]) and "gil_in" in ours["calls"][0]  # --gil-clock
    causes = dict.fromkeys(CAUSES, 0)
    for call, ratio in zip(ours["calls"], stream, strict=True):
        if ratio > 2:
            at = call["at"] + offset
            spans = ours.get("timeline", ())
            beside = [f"{w} {p} {src}".strip() for w, p, src, s, e in spans if s <= at <= e + 0.05]
            began = at - call["seconds"]
            beside += [
                f"gc gen{gen} {ms} ms in {where}"
                for s, ms, gen, where in ours.get("collections", ())
                if s <= at and s + ms / 1e3 >= began
            ]
            late_ms = round(call["late"] * 1e3, 1)
            if clocked:
                gil_ms = [round(call["gil_late"] * 1e3, 1), round(call["gil_in"] * 1e3, 1)]
                causes[_cause(call, medians[call["size"]])] += 1
                slow.append([round(at, 3), call["stage"], round(ratio, 2), late_ms, *gil_ms, beside[:4]])
            else:
                slow.append([round(at, 3), call["stage"], round(ratio, 2), late_ms, beside[:4]])
    return {
        "eager_first_output_s": round(eager["first_output"], 3),
        "tessera_first_output_s": round(ours["first_output"], 3),
        "first_output_ratio": round(ours["first_output"] / eager["first_output"], 3),
        "eager_median_call_ms": round(eager_median * 1e3, 3),
        "tessera_median_call_ms": round(statistics.median(c["seconds"] for c in ours["calls"]) * 1e3, 3),
        "worst_call_ratio": round(max(stream), 2),
        "calls_over_2x": sum(r > 2 for r in stream),
        "calls_over_2x_by_stage": over_by_stage,
        "worst_call_stage_and_second": [ours["calls"][worst]["stage"], ours["calls"][worst]["at"]],
        "p99_call_ratio": p99(stream),
        # [second from process start, stage, ratio, ms late, (--gil-clock: ms of it for the GIL, ms
        # waiting for the GIL in the call,) beside]
        "slow_calls": slow[:40],
        **({"slow_call_causes": causes} if clocked else {}),
        "calls": len(stream),
        "eager_worst_call_ratio": round(max(eager_stream), 2),
        "eager_calls_over_2x": sum(r > 2 for r in eager_stream),
        "eager_p99_call_ratio": p99(eager_stream),
        "eager_calls": len(eager_stream),
        "calls_by_stage_at_start": by_stage,
        "seconds_to_traced": ours["seconds_to_traced"],
        "seconds_to_ready": ours["seconds_to_ready"],
        "traces_landed_s": ours["traces_landed_s"],
        "learnt": ours.get("learnt", []),
        "compiled_here": ours.get("compiled_here"),
        "compiled_by_worker": ours.get("compiled_by_worker"),
        # Garbage collections of over 5 ms in tessera's process during the stream, by generation.
        "collections_over_5ms": _long_collections(ours),
        "steady_ratio": round(ours["steady_median"] / eager["steady_median"], 3),
        "max_abs_diff": max(diffs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between calls of the stream")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument(
        "--trace-first", action="store_true", help="also tessera without eager first (the default)"
    )
    parser.add_argument(
        "--priorities",
        default="low",
        help="background_priority values to run tessera at, comma-separated; the first is the "
        "result, the others are reported under 'priority_<value>' (e.g. low,normal)",
    )
    parser.add_argument(
        "--first-output-runs",
        type=int,
        default=5,
        help="pairs of fresh processes (eager, tessera) timed to the first output only, per model",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="intra-op threads of every process (torch.set_num_threads; 0: torch's default). "
        "On the 2-core CPU, 1 removes the machine's own noise: eager's calls on two threads "
        "stall for 10-20 ms eight times a second, on one they do not (benchmarks/eager_noise.py)",
    )
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.first_output_runs < 0 or (args.seconds <= 0 and not args.child):
        parser.error("--seconds must be positive and --first-output-runs at least 0")
    if args.child:
        name, impl = args.child
        print(json.dumps(child(name, impl, args.seconds, args.gap, args.threads)))
        return 0
    as_installed()
    result: dict[str, Any] = {**header("first_minute"), "seconds": args.seconds, "gap": args.gap}
    result["threads"] = args.threads or "default"
    for name in args.models.split(","):
        eager = _run(name, "eager", args.seconds, args.gap, threads=args.threads)
        first, *others = args.priorities.split(",")
        ours = _run(name, "tessera", args.seconds, args.gap, first, args.threads)
        result[name] = {"background_priority": first, **_compare(eager, ours)}
        if args.first_output_runs:
            result[name]["first_output_pairs"] = _first_outputs(name, args.first_output_runs)
        for priority in others:
            other = _run(name, "tessera", args.seconds, args.gap, priority, args.threads)
            result[name][f"priority_{priority}"] = _compare(eager, other)
        if args.trace_first:
            traced = _run(name, "tessera-trace-first", args.seconds, args.gap, threads=args.threads)
            result[name]["trace_first"] = _compare(eager, traced)
        print(json.dumps({name: result[name]}), file=sys.stderr, flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
