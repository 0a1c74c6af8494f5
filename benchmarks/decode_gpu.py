"""Decode-step latency on a GPU (eager, stock, reduce-overhead, tessera piecewise/full); JSON.

Run on a CUDA machine: ``python benchmarks/decode_gpu.py > benchmarks/results/<date>_<gpu>_decode.json``.
"""

from __future__ import annotations

from tessera.cli.bench.decode_gpu import main

if __name__ == "__main__":
    raise SystemExit(main())
