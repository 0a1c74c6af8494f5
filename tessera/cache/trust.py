"""Whose files the cache trusts, and the modes it creates them with.

A cache entry holds code (pickles, compiled kernels), so tessera loads nothing from a root or entry
that another user owns or can write: entries are created 0700/0600 and checked before every load.
``TESSERA_CACHE_SHARED=group`` opts in to a cache shared by one group (0770/0660, setgid
directories); what others can write is refused either way.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path
from typing import NamedTuple

from tessera.errors import CacheWarning, ConfigError

_WARNED: set[tuple[str, str]] = set()


def shared_group() -> bool:
    """Whether ``TESSERA_CACHE_SHARED=group`` opts in to a cache shared by one group."""
    value = os.environ.get("TESSERA_CACHE_SHARED", "").strip().lower()
    if value in ("", "0", "no", "off", "false", "none"):
        return False
    if value == "group":
        return True
    raise ConfigError(f"TESSERA_CACHE_SHARED={value!r}: the only sharing mode is 'group' (unset for private)")


def dir_mode() -> int:
    return 0o2770 if shared_group() else 0o700


def file_mode() -> int:
    return 0o660 if shared_group() else 0o600


def make_dir(path: Path) -> None:
    """Create ``path`` and its missing parents with the cache's directory mode."""
    for _ in range(10):
        try:
            _make_missing(path)
            return
        except FileNotFoundError:
            # `cache prune` removes an entry's parents once empty: one may go between our mkdirs.
            continue
    _make_missing(path)


def _make_missing(path: Path) -> None:
    missing = []
    for parent in (path, *path.parents):
        if parent.exists():
            break
        missing.append(parent)
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=dir_mode())
        except FileExistsError:
            continue
        if shared_group():  # mkdir's mode is masked by the umask; the group bits must stay
            os.chmod(directory, dir_mode())


def problem(path: Path) -> str | None:
    """Why ``path`` must not be trusted (owned by another user, writable by others), or None."""
    if not hasattr(os, "getuid"):  # not POSIX: no owners to check
        return None
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    if info.st_mode & stat.S_IWOTH:
        return "writable by other users (chmod o-w, or use a private cache directory)"
    if shared_group():
        # A fleet's cache: any member of the group may have written it, nobody else.
        if info.st_uid != os.getuid() and info.st_gid not in {os.getgid(), *os.getgroups()}:
            return f"owned by uid {info.st_uid} and group {info.st_gid}, neither this user nor its groups"
        return None
    if info.st_uid != os.getuid():
        return (
            f"owned by uid {info.st_uid}, not by this user (uid {os.getuid()}); use your own cache "
            "directory, or TESSERA_CACHE_SHARED=group for a cache shared by one group"
        )
    if info.st_mode & stat.S_IWGRP:
        return "writable by its group (chmod g-w, or set TESSERA_CACHE_SHARED=group to share it)"
    return None


class Untrusted(NamedTuple):
    """A path tessera does not trust, and why."""

    path: Path
    why: str


def chain_problem(root: Path, path: Path) -> Untrusted | None:
    """The first of ``root`` and the directories from it down to ``path`` that is not trusted."""
    try:
        relative = path.relative_to(root)
    except ValueError:
        return Untrusted(path, "outside the cache root")
    current = root
    for part in ("", *relative.parts):
        current = current / part if part else current
        found = problem(current)
        if found is not None:
            return Untrusted(current, found)
    return None


def warn_once(path: Path, why: str, consequence: str) -> None:
    """One CacheWarning per path and cause per process, naming both and what was done."""
    key = (str(path), why)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"tessera cache: {path}: {why}; {consequence}", CacheWarning, stacklevel=3)
