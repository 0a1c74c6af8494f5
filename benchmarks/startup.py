"""Process start to first output, cold and warm: tessera vs stock torch.compile vs mega-cache.

Run: ``python benchmarks/startup.py [--models toy4 ...] [--repeats 3] [--cold-scaling 2 8]``; prints JSON.
"""

from __future__ import annotations

from tessera.cli.bench.startup import main

if __name__ == "__main__":
    raise SystemExit(main())
