"""tessera's benchmarks: a package of the source repository, not shipped in the wheel.

Run each from the repository root as ``python -m benchmarks.<name>``. Each prints JSON and compares
tessera with eager and stock ``torch.compile`` in the same run. (Results recorded before the
package existed name the old form, ``python benchmarks/<name>.py``: the same benchmark.)
"""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parents[1])


@contextlib.contextmanager
def cold_caches() -> Iterator[Path]:
    """This process's tessera and Inductor caches in a fresh temporary directory (yielded): a cold
    start, for a diagnosis that runs in its own process (gil_holders, gil_waits)."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TESSERA_CACHE_DIR"] = str(Path(cache) / "tessera")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cache) / "inductor")
        yield Path(cache)


def as_installed() -> None:
    """Compile tessera's bytecode, as ``pip install`` does for a wheel. A benchmark that times a
    process's first output calls it first: an editable checkout run with
    ``PYTHONDONTWRITEBYTECODE`` would compile tessera's sources in every process (about 0.1 s on
    the 2-core CPU), while torch's come precompiled."""
    import compileall

    compileall.compile_dir(Path(ROOT) / "tessera", quiet=1)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark's fresh process (``python -m benchmarks.<name> --child``):
    this one's, with the repository on ``PYTHONPATH`` so that the child finds this package from
    any working directory, and ``extra`` set. This process's own environment is left alone."""
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    python_path = os.pathsep.join(filter(None, [ROOT, *[p for p in paths if p != ROOT]]))
    return {**os.environ, "PYTHONPATH": python_path, **extra}


def header(name: str) -> dict[str, Any]:
    """What every benchmark's JSON starts with: which benchmark, when, on what machine and torch."""
    import torch

    return {
        "benchmark": name,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        },
        "torch": torch.__version__,
        "python": platform.python_version(),
        # The TESSERA_ settings the run was made under (TESSERA_COMPILE_WORKERS=1, ...).
        "tessera_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TESSERA_")},
    }
