"""Subprocess helper for the liveness tests: ``cache prune --max-size 0`` over and over.

Usage: python -m tests.run_pruner ROOT STOP
Prunes ROOT down to nothing (whatever no process uses) until the file STOP exists, then prints
how many entries it removed and how many times it pruned, as JSON. Any exception fails it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tessera.cache.tools import prune


def main() -> int:
    root, stop = Path(sys.argv[1]), Path(sys.argv[2])
    removed = rounds = 0
    while not stop.exists():
        removed += len(prune(root, 0))
        rounds += 1
    json.dump({"removed": removed, "rounds": rounds}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
