"""Run one of the tests' helper modules (``tests.run_toy`` ...) in a fresh process.

Each child gets its own cache root through ``TESSERA_CACHE_DIR`` and the repository on its path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def child_env(cache: Path, **extra: str) -> dict[str, str]:
    """This process's environment, with ``cache`` as tessera's root and ``extra`` on top. A child's
    exit waits for its background compiles (``finish_at_exit``), so that the next child finds
    every artifact; the tests of the exit itself set it otherwise."""
    base = {"TESSERA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), "TESSERA_FINISH_AT_EXIT": "1"}
    return {**os.environ, **base, **extra}


def run_module(
    module: str, *args: str, cache: Path, timeout: int = 900, **env: str
) -> subprocess.CompletedProcess[str]:
    """``python -m module *args`` from the repository root; asserts that it succeeded."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=child_env(cache, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_json(module: str, *args: str, cache: Path, timeout: int = 900, **env: str) -> dict[str, Any]:
    """The JSON report a helper module prints as its last line."""
    proc = run_module(module, *args, cache=cache, timeout=timeout, **env)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_toy(cache: Path, out: Path, *args: str, **env: str) -> dict[str, Any]:
    """``tests.run_toy`` in a fresh process: its counters and what it saved to ``out``."""
    return run_json("tests.run_toy", str(out), *args, cache=cache, **env)
