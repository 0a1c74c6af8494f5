"""Operator tools over a cache root: list, explain, verify, clear and prune entries.

Pure functions returning records or lines; ``tessera cache ...`` (cli.py) prints them.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.cache import FACTORS, INDEX, INUSE, exclusive_if_unused, parse_index, sha256_file
from tessera.cachekey import factor_differences


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
        index = parse_index((path / INDEX).read_text(encoding="utf-8"))
        created = index["created"]
        for size, piece, _ in index["entries"]:
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
    """Problems found (empty: every index parses and every artifact matches its checksum)."""
    problems = []
    for path in find_entries(root):
        try:
            index = parse_index((path / INDEX).read_text(encoding="utf-8"))
        except FileNotFoundError:
            problems.append(f"{path / INDEX}: missing")
            continue
        except (ValueError, SyntaxError, UnicodeDecodeError) as e:
            problems.append(f"{path / INDEX}: unreadable ({type(e).__name__})")
            continue
        try:
            json.loads((path / FACTORS).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            problems.append(f"{path / FACTORS}: {type(e).__name__}")
        for key, record in index["entries"].items():
            artifact = path / record["file"]
            if not artifact.exists():
                problems.append(f"{artifact}: missing (entry {key})")
            elif sha256_file(artifact) != record["sha256"]:
                problems.append(f"{artifact}: checksum mismatch (entry {key})")
    return problems


def clear(root: Path) -> int:
    """Remove every entry not in use by a running process; return how many were removed."""
    removed = 0
    for path in find_entries(root):
        if _remove_if_unused(path):
            removed += 1
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


def _load_factors(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / FACTORS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _sources(path: Path) -> dict[str, str]:
    out = {}
    for snapshot in (path / "sources").glob("*@*"):
        try:
            out[snapshot.name] = snapshot.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
    return out


def explain(root: Path, entry: Path | None = None) -> list[str]:
    """Why ``entry`` (default: the newest) missed: the factors that differ from its nearest entry."""
    entries = find_entries(root)
    if not entries:
        return [f"no cache entries under {root}"]
    infos = {p: entry_info(p) for p in entries}
    target = entry or max(entries, key=lambda p: infos[p].created)
    new = _load_factors(target)
    if new is None:
        return [f"{target}: no readable {FACTORS}"]
    candidates = [p for p in entries if p != target and _load_factors(p) is not None]
    same_prefix = [p for p in candidates if p.name == target.name] or candidates
    if not same_prefix:
        return [f"{target} is the only entry: a first compile, nothing to compare with"]

    def distance(p: Path) -> int:
        return len(factor_differences(new, _load_factors(p) or {}))

    nearest = min(same_prefix, key=distance)
    old = _load_factors(nearest) or {}
    new_text = {k.rsplit("@", 1)[0]: v for k, v in _sources(target).items() if _in(k, new)}
    old_text = {k.rsplit("@", 1)[0]: v for k, v in _sources(nearest).items() if _in(k, old)}
    lines = [f"entry {target}", f"nearest existing entry {nearest}; differences:"]
    differences = factor_differences(new, old, new_text, old_text)
    lines.extend(f"  - {d}" for d in differences or ["(none: the entries have equal factors)"])
    return lines


def _in(snapshot_name: str, factors: dict[str, Any]) -> bool:
    return snapshot_name in factors.get("sources", {})


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
