"""Cold start: process start to first output, and to every size ready, with empty caches; JSON out.

Per layer count of the width-256 toy Llama, each run in a fresh process with empty tessera and
Inductor caches: stock ``torch.compile`` (one dynamic graph), tessera serving first and compiling
``compile_sizes=[1, 16]`` and ``compile_ranges=[8]`` in the background, and tessera compiling every
size up front. Runs are interleaved so that drift on the machine falls on all alike.

Also the batch-1 decode service (``--size-one-layers``): 20 calls of size 1 with ``compile_sizes``
listing 1, then each call against eager, in the first process and in the next (warm) one.

Compile workers against none (``--workers-layers``): every size ready, up front and in the background.

Run: ``python -m benchmarks.cold_start [--layers 4 16 32] [--repeats 1] [--size-one-layers 4]
[--workers N] [--workers-layers 4 16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import child_env, header
from benchmarks.startup import TOY_WIDTH

IMPLS = ("stock", "tessera_background", "tessera_up_front")
TOKENS = 23  # the first call's size: a prompt, in none of the compile sizes


def child(impl: str, layers: int) -> None:
    """The measured process: build, compile, first output, then wait until every size is ready."""
    import torch

    from tessera.models import toy_llama

    model = toy_llama.build(num_layers=layers, **TOY_WIDTH)
    args = toy_llama.example_inputs(TOKENS)
    marks: dict[str, float] = {"built": time.time()}
    if impl == "stock":
        torch._dynamo.mark_dynamic(args[0], 0)
        torch._dynamo.mark_dynamic(args[1], 0)
        compiled: Any = torch.compile(model)
    else:
        import tessera

        compiled = tessera.compile(
            model,
            compile_sizes=[1, 16],
            compile_ranges=[8],
            background_compile=impl == "tessera_background",
        )
    with torch.no_grad():
        compiled(*args)
    marks["first_output"] = time.time()
    if impl != "stock":
        assert compiled.wait_ready(3600)
    marks["all_ready"] = time.time()
    report: dict[str, Any] = {"marks": marks}
    if impl != "stock":
        import tessera

        report["counters"] = tessera.counters.snapshot()
        report["summary"] = compiled.report.summary()
    print(json.dumps(report))


def size_one_child(layers: int) -> None:
    """A batch-1 decode service: 20 calls of size 1, then tessera against eager, interleaved."""
    import torch

    import tessera
    from tessera.models import toy_llama

    model = toy_llama.build(num_layers=layers, **TOY_WIDTH)
    args = toy_llama.example_inputs(1)
    compiled = tessera.compile(model, compile_sizes=[1, 16], compile_ranges=[8])
    with torch.no_grad():
        start = time.perf_counter()
        compiled(*args)
        first = time.perf_counter() - start
        for _ in range(19):
            compiled(*args)
        torch.testing.assert_close(compiled(*args), model(*args))
        rounds: dict[str, list[float]] = {"tessera": [], "eager": []}
        for _ in range(7):
            for name, fn in (("tessera", compiled), ("eager", model)):
                start = time.perf_counter()
                for _ in range(50):
                    fn(*args)
                rounds[name].append((time.perf_counter() - start) / 50)
    best = {name: min(times) for name, times in rounds.items()}
    print(
        json.dumps(
            {
                "start": compiled.report.kind if compiled.report is not None else None,
                "first_call_s": first,
                "tessera_ms": best["tessera"] * 1e3,
                "eager_ms": best["eager"] * 1e3,
                "counters": tessera.counters.snapshot(),
            }
        )
    )


def size_one(layers: int) -> dict[str, Any]:
    """Acceptance of the size-1 service: the first process and the next, which starts warm."""
    out: dict[str, Any] = {"layers": layers}
    with tempfile.TemporaryDirectory() as scratch:
        env = {
            **child_env(),
            "TESSERA_CACHE_DIR": os.path.join(scratch, "tessera"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
            "TESSERA_PROGRESS": "0",
        }
        for process in ("first_process", "next_process"):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.cold_start", "--size-one-child", str(layers)],
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"size-one {process} failed: {proc.stderr[-2000:]}")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            out[process] = {
                "start": result["start"],
                "first_call_s": round(result["first_call_s"], 3),
                "tessera_ms": round(result["tessera_ms"], 4),
                "eager_ms": round(result["eager_ms"], 4),
                "tessera_vs_eager": round(result["tessera_ms"] / result["eager_ms"], 3),
                "inductor_compiles": result["counters"]["inductor_compiles"],
            }
            print(f"size one {layers} layers {process}: {out[process]}", file=sys.stderr, flush=True)
    return out


def run(impl: str, layers: int, workers: int | None = None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as scratch:
        env = {
            **child_env(),
            **({"TESSERA_COMPILE_WORKERS": str(workers)} if workers is not None else {}),
            "TESSERA_CACHE_DIR": os.path.join(scratch, "tessera"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
            "TESSERA_PROGRESS": "0",
        }
        start = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.cold_start", "--child", impl, str(layers)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        exited = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} {layers} layers failed: {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    marks = report["marks"]
    return {
        "first_output_s": marks["first_output"] - start,
        "all_ready_s": marks["all_ready"] - start,
        "process_s": exited - start,
    }


def workers_row(layers: int, workers: int, repeats: int) -> dict[str, Any]:
    """Compile workers against none: first output and every size ready, up front and in the
    background, interleaved, the median of ``repeats``."""
    cases = [(impl, n) for impl in IMPLS[1:] for n in (0, workers)]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {case: [] for case in cases}
    for _ in range(repeats):
        for impl, n in cases:
            runs[impl, n].append(run(impl, layers, n))
            print(f"{layers} layers {impl} workers={n}: {runs[impl, n][-1]}", file=sys.stderr, flush=True)
    row: dict[str, Any] = {"layers": layers, "workers": workers}
    for (impl, n), results in runs.items():
        for figure in ("first_output_s", "all_ready_s"):
            row[f"{impl}_workers{n}_{figure}"] = round(statistics.median(r[figure] for r in results), 2)
    for impl in IMPLS[1:]:
        row[f"{impl}_all_ready_workers_vs_none"] = round(
            row[f"{impl}_workers{workers}_all_ready_s"] / row[f"{impl}_workers0_all_ready_s"], 3
        )
    return row


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--child"]:
        child(args[1], int(args[2]))
        return 0
    if args[:1] == ["--size-one-child"]:
        size_one_child(int(args[1]))
        return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="*", default=[4, 16, 32])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--size-one-layers", type=int, nargs="*", default=[4])
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="compile workers (default: tessera's choice); compared with none in --workers-layers",
    )
    parser.add_argument("--workers-layers", type=int, nargs="*", default=[])
    options = parser.parse_args(args)
    size_one_rows = [size_one(layers) for layers in options.size_one_layers]
    compared = options.workers if options.workers else 1
    worker_rows = [workers_row(layers, compared, options.repeats) for layers in options.workers_layers]
    rows = []
    for layers in options.layers:
        runs: dict[str, list[dict[str, float]]] = {impl: [] for impl in IMPLS}
        for _ in range(options.repeats):
            for impl in IMPLS:
                runs[impl].append(run(impl, layers, options.workers))
                print(f"{layers} layers {impl}: {runs[impl][-1]}", file=sys.stderr, flush=True)
        row: dict[str, Any] = {"layers": layers}
        for impl, results in runs.items():
            for figure in ("first_output_s", "all_ready_s"):
                row[f"{impl}_{figure}"] = round(statistics.median(r[figure] for r in results), 2)
        row["background_first_output_vs_stock"] = round(
            row["tessera_background_first_output_s"] / row["stock_first_output_s"], 3
        )
        row["background_all_ready_vs_up_front"] = round(
            row["tessera_background_all_ready_s"] / row["tessera_up_front_all_ready_s"], 3
        )
        rows.append(row)
    config = {"compile_sizes": [1, 16], "compile_ranges": [8], "first_call_tokens": TOKENS, **TOY_WIDTH}
    print(
        json.dumps(
            {
                **header("cold_start"),
                "config": config,
                "repeats": options.repeats,
                "workers": options.workers,
                "rows": rows,
                "compile_workers": worker_rows,
                "size_one": size_one_rows,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
