"""Subprocess helper for the liveness tests: a cache writer caught in the middle of a write.

Usage: python -m tests.run_writer ROOT
Opens an entry under ROOT as a compiling process does, then writes a file into it with
``atomic_write``: once the temp file is complete it prints the temp file's path and waits for a
line on stdin before moving it into place. Exits 0 (printing the file) only if the write completed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tessera.cache.entry import CacheEntry, atomic_write

CONTENT = b"written by a live process\n"


def main() -> int:
    entry = CacheEntry.create(Path(sys.argv[1]), "model", {"writer": 1}, "graph", [])
    assert entry is not None, "the entry could not be made"
    replace = os.replace

    def paused_replace(src: str, dst: str) -> None:
        sys.stdout.write(f"{src}\n")  # the test holds us here: a writer mid-write, alive
        sys.stdout.flush()
        sys.stdin.readline()
        replace(src, dst)

    os.replace = paused_replace  # atomic_write moves its temp file into place last
    atomic_write(entry.path / "report-writer.json", CONTENT)
    sys.stdout.write(f"{entry.path / 'report-writer.json'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
