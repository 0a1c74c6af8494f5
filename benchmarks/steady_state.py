"""Steady-state per-call latency of eager, stock torch.compile and tessera; prints JSON.

Run: ``python benchmarks/steady_state.py [--quick]`` (same as ``tessera bench``).
"""

from __future__ import annotations

import sys

from tessera.cli.bench.steady_state import main

if __name__ == "__main__":
    raise SystemExit(main(quick="--quick" in sys.argv[1:]))
