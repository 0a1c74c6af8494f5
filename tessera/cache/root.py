"""Where the cache lives, read without the cache's machinery: a cold first call, served eagerly,
asks only whether anything is saved there before it answers (api.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.config import CompileConfig

WARM_DIR = "warm"  # the pointers: a model's fingerprint -> the traces saved for it (pointer.py)


def root_path(configured: str | None) -> Path:
    """The root every model's entries live under: config, ``$TESSERA_CACHE_DIR``, or the user cache."""
    chosen = configured or os.environ.get("TESSERA_CACHE_DIR")
    if not chosen:
        import platformdirs

        chosen = platformdirs.user_cache_dir("tessera")
    return Path(chosen).expanduser()


def holds_no_trace(root: Path) -> bool:
    """Whether no model's traces (nor a path recorded for one) are saved under ``root``: no warm
    start can serve a call from it. False when it cannot be told (a directory it cannot read)."""
    try:
        with os.scandir(root / WARM_DIR) as listing:
            return not any(entry.name.endswith(".json") for entry in listing)
    except FileNotFoundError:  # a fresh node: nothing saved yet
        return True
    except OSError:
        return False


def nothing_saved(config: CompileConfig) -> bool:
    """Whether no saved trace can serve a first call under ``config``: the
    cache is off, or its root holds no model's traces."""
    return config.disable_cache or holds_no_trace(root_path(config.cache_dir))
