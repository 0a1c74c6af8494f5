"""Operator tools over a cache root: list, verify, clear and prune entries.

Pure functions returning records or lines; ``tessera cache ...`` (the CLI) prints them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from tessera.cache import liveness, trust
from tessera.cache.entry import FACTORS, INDEX, check_file, read_index
from tessera.cache.index import FileRecord
from tessera.cache.liveness import INUSE, TOKEN, exclusive_if_unused
from tessera.cache.pointer import PATHS
from tessera.cache.root import WARM_DIR

log = logging.getLogger(__name__)

# What a writer leaves if it is killed, named with its writer token (liveness.py): atomic_write's
# ".<name>.<token>.<random>.tmp" and the compiler's scratch ".piece<n>_<size>_<compiler>.<token>.
# <hex8>" before it is moved into place; at the root, an import's staging ".import-<token>.<random>"
# and a pruner's ".removing.<token>.<hex8>" (an entry moved out of its path to be deleted).
_TEMP = re.compile(rf"^\..+\.({TOKEN})\.[^.]+\.tmp$|^\.piece.*\.({TOKEN})\.[0-9a-f]{{8}}$")
_TEMP_DIR = re.compile(rf"^\.(?:import-|removing\.)({TOKEN})\.")
# The same files from tessera before writer tokens, named with the pid only: judged by the pid.
_LEGACY_TEMP = re.compile(r"^\..*\.(\d+)\.[^.]+\.tmp$|^\.piece.*\.(\d+)\.[0-9a-f]{8}$")


@dataclass(frozen=True)
class EntryInfo:
    """One cache entry as ``tessera cache ls`` shows it."""

    path: Path
    key: str
    prefix: str
    rank: str
    size_bytes: int
    created: float
    last_used: float
    pieces: int
    sizes: tuple[str, ...]


def find_entries(root: Path) -> list[Path]:
    """Entry directories under ``root``: ``<key10>/rank_*/<prefix>/`` holding index or factors."""
    found: list[Path] = []
    for key in _subdirs(root):
        for rank in _subdirs(key):
            if rank.name.startswith("rank_"):
                found.extend(p for p in _subdirs(rank) if (p / INDEX).exists() or (p / FACTORS).exists())
    return sorted(found)


def _subdirs(path: Path) -> list[Path]:
    """The directories in ``path``; none if it is gone (a pruner or clear in another process)."""
    try:
        with os.scandir(path) as it:
            return [Path(e.path) for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _dir_size(path: Path) -> int:
    """Bytes under ``path``; files that go while counting (temp files renamed into place) count 0."""
    total = 0
    for directory, _, files in os.walk(path):  # os.walk skips directories that vanish
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                continue
    return total


def entry_info(path: Path) -> EntryInfo:
    try:
        created = last_used = path.stat().st_mtime
    except OSError:  # removed meanwhile by another process's prune or clear
        created = last_used = 0.0
    pieces: set[int] = set()
    sizes: set[str] = set()
    try:
        index = read_index(path)
        created = index.created
        for size, piece, _ in index.entries:
            pieces.add(piece)
            sizes.add(size if isinstance(size, str) else str(size))
    except (OSError, ValueError, SyntaxError, UnicodeDecodeError):
        pass
    with contextlib.suppress(OSError):  # no marker: never opened since made, its directory's time
        last_used = (path / INUSE).stat().st_mtime
    return EntryInfo(
        path=path,
        key=path.parent.parent.name,
        prefix=path.name,
        rank=path.parent.name,
        size_bytes=_dir_size(path),
        created=created,
        last_used=last_used,
        pieces=len(pieces),
        sizes=tuple(sorted(sizes)),
    )


def verify(root: Path) -> list[str]:
    """Problems found (empty: every entry is trusted, its index parses and every file matches
    its checksum, the whole-model artifact included)."""
    problems = []
    for path in find_entries(root):
        found = _entry_problems(root, path)
        if found and not path.is_dir():
            continue  # removed meanwhile by another process's prune or clear: nothing to report
        problems += found
    return problems


def _entry_problems(root: Path, path: Path) -> list[str]:
    untrusted = trust.chain_problem(root, path)
    if untrusted is not None:
        return [f"{untrusted.path}: not trusted, {untrusted.why} (entry {path})"]
    try:
        index = read_index(path)
    except FileNotFoundError:
        return [f"{path / INDEX}: missing"]
    except (OSError, ValueError, SyntaxError, UnicodeDecodeError) as e:
        return [f"{path / INDEX}: unreadable ({type(e).__name__})"]
    problems = []
    try:
        json.loads((path / FACTORS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        problems.append(f"{path / FACTORS}: {type(e).__name__}")
    records: list[tuple[str, FileRecord]] = [(f"entry {k}", r) for k, r in index.entries.items()]
    for name, sha in index.files.items():
        try:
            size = (path / name).stat().st_size
        except OSError:
            size = -1
        records.append(("side file", FileRecord(name, sha, size)))
    if index.model is not None:
        records.append(("whole-model artifact", index.model))
    for what, record in records:
        problem = check_file(path, record)
        if problem is not None:
            problems.append(f"{path / record.file}: {problem} ({what})")
    return problems


def clear(root: Path) -> int:
    """Remove every entry not in use by a running process, the pointers to removed entries and
    stray temp files; return how many entries were removed."""
    liveness.register_root(root)
    removed = 0
    for path in find_entries(root):
        if _remove_if_unused(path):
            removed += 1
    _tidy(root)
    return removed


def prune(root: Path, max_bytes: int) -> list[Path]:
    """Remove least recently used entries until the root holds at most ``max_bytes``.

    Entries in use by a running process are never removed.
    """
    liveness.register_root(root)
    infos = sorted((entry_info(p) for p in find_entries(root)), key=lambda e: e.last_used)
    total = sum(e.size_bytes for e in infos)
    removed = []
    for info in infos:
        if total <= max_bytes:
            break
        if _remove_if_unused(info.path):
            total -= info.size_bytes
            removed.append(info.path)
    _tidy(root)
    return removed


def _tidy(root: Path) -> None:
    for stray in stray_temp_files(root):
        if stray.is_dir() and not stray.is_symlink():
            shutil.rmtree(stray, ignore_errors=True)
        else:
            stray.unlink(missing_ok=True)
    liveness.remove_dead_writer_locks(root)
    remove_dangling_pointers(root)


def stray_temp_files(root: Path) -> list[Path]:
    """Temp files (and an import's or a pruner's temp directories) whose writer is gone: no
    process holds the writer lock their name's token stands for (see liveness.py)."""
    found: list[Path] = []
    for directory, dirs, files in os.walk(root):  # os.walk skips directories that vanish
        here = Path(directory)
        alive: dict[str, bool] = {}  # per token, for this directory (its locks are its parents')
        gone = {d for d in dirs if _writer_gone(_TEMP_DIR.match(d), here, root, alive)}
        dirs[:] = [d for d in dirs if d not in gone]  # removed whole: not walked into
        found += [here / d for d in gone]
        for name in files:
            match = _TEMP.match(name)
            if match is not None:
                stray = _writer_gone(match, here, root, alive)
            else:
                stray = _legacy_writer_gone(_LEGACY_TEMP.match(name), here / name)
            if stray:
                found.append(here / name)
    return sorted(found)


def _writer_gone(match: re.Match[str] | None, here: Path, root: Path, alive: dict[str, bool]) -> bool:
    if match is None:
        return False
    token = match[1] or match[2]
    if token not in alive:
        alive[token] = liveness.writer_alive(token, here, root)
    return not alive[token]


def _legacy_writer_gone(match: re.Match[str] | None, path: Path) -> bool:
    """A temp file of tessera before writer tokens: only its pid says who wrote it. Pids are
    reused and differ per container, so this can be wrong; such files stop appearing once every
    process sharing the cache runs a tessera with writer locks (then this can go)."""
    return match is not None and not _legacy_writer_alive(int(match[1] or match[2]), path)


def _legacy_writer_alive(pid: int, path: Path) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    try:  # Linux: a pid reused after the file was written is another process
        return os.stat(f"/proc/{pid}").st_mtime <= path.stat().st_mtime
    except OSError:
        return True


def remove_dangling_pointers(root: Path) -> list[Path]:
    """Remove ``warm/`` pointers to entries that no longer exist (or that cannot be read).

    Records of a model's path (graph breaks) point to no entry and are kept.
    """
    removed = []
    for pointer in sorted((root / WARM_DIR).glob("*.json")):
        held = None
        try:
            with pointer.open("rb") as f:
                held = os.fstat(f.fileno())
                data = json.loads(f.read().decode("utf-8"))
            if isinstance(data, dict) and data.get("path") in PATHS:
                continue
            listed = data.get("entries", [data])
            # Dangling when every trace it lists is gone (a live one still starts warm).
            target = next((root / e["entry"] for e in listed if (root / e["entry"]).is_dir()), None)
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError):
            target = None
        if held is not None and (target is None or not target.is_dir()):
            # Only the pointer we read: a process may have just replaced it with a good one.
            try:
                now = pointer.stat()
            except OSError:
                continue
            if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                pointer.unlink(missing_ok=True)
                removed.append(pointer)
    return removed


def _remove_if_unused(path: Path) -> bool:
    root = path.parents[2]
    with exclusive_if_unused(path) as free:
        if not free:
            return False
        # Moved out of its path at once: a process opening the entry from now on finds nothing
        # (a plain miss) instead of a half-deleted entry. Deleted after the lock is let go.
        trash: Path | None = None
        try:
            trash = root / f".removing.{liveness.writer_token(root)}.{secrets.token_hex(4)}"
            os.rename(path, trash)
        except OSError as e:  # another filesystem under the root: deleted in place, still locked
            log.debug("cannot move %s out of the way (%s); deleting it in place", path, e)
            shutil.rmtree(path, ignore_errors=True)
            if path.exists():  # read-only, or not ours to delete
                return False
            trash = None
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    for parent in (path.parent, path.parent.parent):  # drop empty rank_/key dirs
        try:
            parent.rmdir()
        except OSError:
            break
    return True


def parse_size(text: str) -> int:
    """``500M``, ``2G``, ``1.5GiB`` or plain bytes → bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not match:
        raise ValueError(f"cannot read size {text!r}; use e.g. 500M or 2G")
    number, unit = float(match.group(1)), match.group(2)
    return int(number * 1024 ** " kmgt".index(unit or " "))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
