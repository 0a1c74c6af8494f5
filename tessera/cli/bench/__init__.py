"""Benchmarks shipped with the package (``benchmarks/*.py`` and ``tessera bench`` run them)."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from typing import Any


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
    }
