"""Time from process start to first output, cold and warm, each in a fresh process; JSON out.

tessera (its cache) against stock torch.compile (Inductor's FX/AOT caches) and PyTorch's
mega-cache (save_cache_artifacts / load_cache_artifacts), toy Llama with 4 and 16 layers.
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
from pathlib import Path
from typing import Any

from tessera.cli.bench import header

WIDTH: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_heads": 8, "num_kv_heads": 4}


def child(impl: str, layers: int, mega: str | None) -> None:
    """Runs in the measured process: build, compile, first call, report."""
    import torch

    import tessera
    from tessera.models import toy_llama

    model = toy_llama.build(num_layers=layers, **WIDTH)
    ids, pos = toy_llama.example_inputs(16)
    if impl == "tessera":
        compiled: Any = tessera.compile(model, backend="inductor")
    else:
        if impl == "mega-load" and mega:
            torch.compiler.load_cache_artifacts(Path(mega).read_bytes())
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        compiled = torch.compile(model, backend="inductor")
    with torch.no_grad():
        compiled(ids, pos)
    first_output = time.time()
    if impl == "mega-save" and mega:
        saved = torch.compiler.save_cache_artifacts()
        assert saved is not None, "mega-cache saved nothing"
        Path(mega).write_bytes(saved[0])
    print(json.dumps({"first_output": first_output, "counters": tessera.counters.snapshot()}))


def _run(impl: str, layers: int, inductor_dir: str, tessera_dir: str, mega: str | None) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_dir, TESSERA_CACHE_DIR=tessera_dir)
    cmd = [sys.executable, "-m", "tessera.cli.bench.startup", "--child", impl, "--layers", str(layers)]
    if mega:
        cmd += ["--mega", mega]
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{impl} child failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"seconds": report["first_output"] - start, "counters": report["counters"]}


def measure(layers: int, repeats: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {}
    counters: dict[str, Any] = {}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as scratch:
            d = Path(scratch)
            runs = [
                ("tessera_cold", "tessera", "ind-t", "tess", None),
                ("tessera_warm", "tessera", "ind-t", "tess", None),
                ("stock_cold", "stock", "ind-s", "unused", None),
                ("stock_warm", "stock", "ind-s", "unused", None),
                ("megacache_save_cold", "mega-save", "ind-m1", "unused", str(d / "mega.bin")),
                ("megacache_warm", "mega-load", "ind-m2", "unused", str(d / "mega.bin")),
            ]
            for name, impl, ind, tess, mega in runs:
                result = _run(impl, layers, str(d / ind), str(d / tess), mega)
                out.setdefault(name, []).append(result["seconds"])
                counters[name] = result["counters"]
    medians = {name: statistics.median(v) for name, v in out.items()}
    return {
        "layers": layers,
        "seconds_median": medians,
        "seconds_all": out,
        "tessera_warm_over_cold": medians["tessera_warm"] / medians["tessera_cold"],
        "tessera_warm_over_stock_warm": medians["tessera_warm"] / medians["stock_warm"],
        "tessera_warm_over_megacache_warm": medians["tessera_warm"] / medians["megacache_warm"],
        "tessera_warm_counters": counters["tessera_warm"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--layers", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--mega")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.layers[0], args.mega)
        return 0

    result = {
        **header("startup"),
        "model": {"family": "toy_llama", **WIDTH},
        "results": [measure(layers, args.repeats) for layers in args.layers],
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
