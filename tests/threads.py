"""Test helper: run a function in a thread of its own (a thread's own priority, OpenMP count)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, called in a new thread."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]
