"""Operator tools over a cache root: list, verify, clear and prune entries.

Pure functions returning records or lines; ``tessera cache ...`` (the CLI) prints them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tessera.cache import trust
from tessera.cache.artifact import WARM_DIR
from tessera.cache.index import FileRecord
from tessera.cache.store import FACTORS, INDEX, INUSE, check_file, exclusive_if_unused, read_index

# Temp files a writer leaves if it is killed: atomic_write's ".<name>.<pid>.<random>.tmp" and the
# compiler's scratch ".piece<n>_<size>_<compiler>.<pid>.<hex8>" before it is moved into place.
_TEMP = re.compile(r"^\..*\.(\d+)\.[^.]+\.tmp$|^\.piece.*\.(\d+)\.[0-9a-f]{8}$")


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
    if not root.is_dir():
        return []
    found = []
    for path in root.glob("*/rank_*/*"):
        if path.is_dir() and ((path / INDEX).exists() or (path / FACTORS).exists()):
            found.append(path)
    return sorted(found)


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def entry_info(path: Path) -> EntryInfo:
    created = last_used = path.stat().st_mtime
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
    if (path / INUSE).exists():
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
        untrusted = trust.chain_problem(root, path)
        if untrusted is not None:
            problems.append(f"{untrusted[0]}: not trusted, {untrusted[1]} (entry {path})")
            continue
        try:
            index = read_index(path)
        except FileNotFoundError:
            problems.append(f"{path / INDEX}: missing")
            continue
        except (OSError, ValueError, SyntaxError, UnicodeDecodeError) as e:
            problems.append(f"{path / INDEX}: unreadable ({type(e).__name__})")
            continue
        try:
            json.loads((path / FACTORS).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            problems.append(f"{path / FACTORS}: {type(e).__name__}")
        records: list[tuple[str, FileRecord]] = [(f"entry {k}", r) for k, r in index.entries.items()]
        for name, sha in index.files.items():
            size = (path / name).stat().st_size if (path / name).exists() else -1
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
        stray.unlink(missing_ok=True)
    remove_dangling_pointers(root)


def stray_temp_files(root: Path) -> list[Path]:
    """Temp files whose writer is gone (its pid runs no more, or was reused after the write)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.rglob(".*"):
        match = _TEMP.match(path.name)
        if match is None or not path.is_file():
            continue
        pid = int(match.group(1) or match.group(2))
        if not _writer_alive(pid, path):
            found.append(path)
    return sorted(found)


def _writer_alive(pid: int, path: Path) -> bool:
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
    """Remove ``warm/`` pointers to entries that no longer exist (or that cannot be read)."""
    removed = []
    for pointer in sorted((root / WARM_DIR).glob("*.json")):
        try:
            target = root / json.loads(pointer.read_text(encoding="utf-8"))["entry"]
        except (OSError, ValueError, KeyError, TypeError):
            target = None
        if target is None or not target.is_dir():
            pointer.unlink(missing_ok=True)
            removed.append(pointer)
    return removed


def _remove_if_unused(path: Path) -> bool:
    with exclusive_if_unused(path) as free:
        if not free:
            return False
        shutil.rmtree(path, ignore_errors=True)
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
