"""Every patch tessera makes to torch, in one registry: its name, why, the torch releases it is
needed on, and how it is undone.

Part of tessera._compat. A patch is installed at its first use (``apply``), only where this torch
needs it (each install looks for what it replaces and does nothing where it is missing or fixed
upstream), and stays for the life of the process unless ``remove_all`` takes every one out
(tests do; a process may). ``TESSERA_NO_TORCH_PATCHES=1`` installs none: what each patch keeps
from going wrong beside tessera's threads then goes wrong, as it would without tessera.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

Undo = Callable[[], None]


@dataclass(frozen=True)
class Patch:
    """One patch of torch: its name, why it exists, the torch releases it is needed on, and its
    install, which returns what undoes it (None where this torch needs none).

    Checked on torch 2.11-2.15: a record of tessera's own; it reads no torch API."""

    name: str
    why: str
    torch: str
    install: Callable[[], Undo | None]


# Checked on torch 2.11-2.15: tessera's own registry; each patch names the releases it is for.
REGISTRY: dict[str, Patch] = {}
# Checked on torch 2.11-2.15: tessera's own switch (tests/test_compat.py runs without patches).
OFF_ENV = "TESSERA_NO_TORCH_PATCHES"
_undo: dict[str, Undo] = {}  # the patches in place, in the order installed
_tried: set[str] = set()  # installed, or found not needed here (until remove_all)
_lock = threading.RLock()


def patch(
    name: str, why: str, torch: str
) -> Callable[[Callable[[], Undo | None]], Callable[[], Undo | None]]:
    """Register the decorated install function as the patch ``name``.

    Checked on torch 2.11-2.15: tessera's own registry; no torch API."""

    def register(install: Callable[[], Undo | None]) -> Callable[[], Undo | None]:
        REGISTRY[name] = Patch(name, why, torch, install)
        return install

    return register


def apply(name: str) -> bool:
    """Install the patch ``name`` once (a set lookup after the first time); whether it is in place.

    Checked on torch 2.11-2.15: calls the registered install, which checks its own torch."""
    if name not in _tried:
        with _lock:
            if name not in _tried:
                if not os.environ.get(OFF_ENV):
                    undo = REGISTRY[name].install()
                    if undo is not None:
                        _undo[name] = undo
                _tried.add(name)
    return name in _undo


def installed() -> tuple[str, ...]:
    """The patches in place now, in the order installed.

    Checked on torch 2.11-2.15: tessera's own state."""
    return tuple(_undo)


def remove_all() -> None:
    """Undo every patch in place (the newest first); a later use installs it again.

    Checked on torch 2.11-2.15: calls each patch's own undo."""
    with _lock:
        for name in reversed(list(_undo)):
            _undo.pop(name)()
        _tried.clear()
