"""Cold start: first output and every size ready, empty caches, tessera vs stock torch.compile.

Run: ``python benchmarks/cold_start.py [--layers 4 16 32] [--repeats 1]``; prints JSON.
"""

from __future__ import annotations

from tessera.cli.bench.cold_start import main

if __name__ == "__main__":
    raise SystemExit(main())
