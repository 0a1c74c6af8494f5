"""Warm start on a GPU: a cold then a warm process of a decode model under piecewise CUDA graphs
(Inductor's Triton kernels), each fresh, against eager and stock ``torch.compile`` (cold, then
warm from Inductor's own caches) in the same run. Prints JSON (needs CUDA).

Per process: process start to first output, until every capture size is captured, what was
traced and compiled, and the per-step latency once ready. The warm process must trace and compile
nothing; its *overhead* is (start to ready) minus eager's (start to first output).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import child_env, header

CAPTURE_SIZES = (1, 8)
SIZES: dict[str, Any] = {"num_layers": 4, "hidden_size": 1024, "intermediate_size": 4096}


def child(impl: str, start: float) -> None:
    """The measured process: build, compile, first output, every capture size, then steps."""
    import torch

    from tessera.cli.timing import per_call_seconds
    from tessera.models import toy_llama

    model = toy_llama.build_decode(
        dtype=torch.bfloat16, device="cuda", max_batch=max(CAPTURE_SIZES), max_len=64, **SIZES
    )

    def inputs(batch: int) -> tuple[Any, Any]:
        return torch.randint(0, 256, (batch,), device="cuda"), torch.full((batch,), 10, device="cuda")

    torch.cuda.synchronize()
    gc.collect()
    report: dict[str, Any] = {"built_s": time.time() - start}
    compiled: Any = model
    if impl == "tessera":
        import tessera

        compiled = tessera.compile(
            model, cudagraph_mode="piecewise", cudagraph_capture_sizes=list(CAPTURE_SIZES), prefix="warm_gpu"
        )
    elif impl == "stock":
        compiled = torch.compile(model, dynamic=True)
    with torch.no_grad():
        compiled(*inputs(CAPTURE_SIZES[-1]))
        torch.cuda.synchronize()
        report["first_output_s"] = time.time() - start
        if impl == "tessera":
            compiled.wait_ready()
        for batch in sorted(CAPTURE_SIZES, reverse=True):  # warm-up, capture, replay
            for _ in range(3):
                compiled(*inputs(batch))
        torch.cuda.synchronize()
        report["ready_s"] = time.time() - start
    report["step_ms"] = {
        str(batch): per_call_seconds(compiled, *inputs(batch), warmup=5, repeats=11, inner=20) * 1e3
        for batch in CAPTURE_SIZES
    }
    if impl == "tessera":
        import tessera

        report["counters"] = tessera.counters.snapshot()
        report["warm_start"] = compiled.warm_start
        report["phases"] = dict(compiled.startup_phases)
    print(json.dumps(report))


def _run(impl: str, env: dict[str, str]) -> dict[str, Any]:
    start = time.time()
    cmd = [sys.executable, "-m", "benchmarks.warm_gpu", "--child", impl, "--start", repr(start)]
    proc = subprocess.run(cmd, env=child_env(**env), capture_output=True, text=True, timeout=900, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} child failed:\n{proc.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", choices=("eager", "tessera", "stock"))
    parser.add_argument("--start", type=float, default=0.0)
    # Five fresh processes, three of them compiling, ran past 160 s on an H100 machine: --no-stock
    # leaves out stock torch.compile's two when device time is short.
    parser.add_argument("--no-stock", action="store_true")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.start)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        env = {"TESSERA_CACHE_DIR": f"{tmp}/tessera", "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"}
        runs = {
            "eager": _run("eager", env),
            "tessera_cold": _run("tessera", env),
            "tessera_warm": _run("tessera", env),
        }
        if not args.no_stock:
            stock = {**env, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/stock"}
            runs["stock_cold"] = _run("stock", stock)
            runs["stock_warm"] = _run("stock", stock)
    eager_first = runs["eager"]["first_output_s"]
    warm = runs["tessera_warm"]
    result = {
        **header("warm_gpu"),
        "model": {**SIZES, "dtype": "bfloat16", "capture_sizes": list(CAPTURE_SIZES)},
        "runs": runs,
        "warm_traced_nothing": warm["counters"]["graphs_traced"] == 0,
        "warm_compiled_nothing": warm["counters"]["inductor_compiles"] == 0,
        "warm_overhead_s": {
            "tessera_first_output": warm["first_output_s"] - eager_first,
            "tessera_ready": warm["ready_s"] - eager_first,
            **(
                {"stock_first_output": runs["stock_warm"]["first_output_s"] - eager_first}
                if "stock_warm" in runs
                else {}
            ),
        },
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
