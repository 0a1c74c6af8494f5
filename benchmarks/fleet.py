"""Eight replicas against one Redis (and four torchrun ranks on one machine) compile once.

Run: ``python benchmarks/fleet.py [--replicas 8] [--ranks 4]``; prints JSON. Needs redis-server.
"""

from __future__ import annotations

from tessera.cli.bench.fleet import main

if __name__ == "__main__":
    raise SystemExit(main())
