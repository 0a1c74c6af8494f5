"""Why a cache entry missed: the factors that differ from its nearest neighbour, in words.

``tessera cache explain`` prints these lines; source files get a one-line diff summary. Each
entry's factors are read as its key record (cache/key.py), checked against the key it is filed under.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tessera.cache.entry import FACTORS
from tessera.cache.key import KeyRecord, entry_key
from tessera.cache.tools import entry_info, find_entries


def factor_differences(
    new: Mapping[str, Any],
    old: Mapping[str, Any],
    new_sources: Mapping[str, str] | None = None,
    old_sources: Mapping[str, str] | None = None,
) -> list[str]:
    """Human-readable lines naming each factor that differs between two factor sets.

    ``*_sources`` map a source file's name to a snapshot of its text, for a diff summary.
    """
    lines: list[str] = []
    if new.get("torch_version") != old.get("torch_version"):
        lines.append(f"torch version: {old.get('torch_version')} -> {new.get('torch_version')}")
    elif new.get("compiler") != old.get("compiler"):
        lines.append("compiler: its hash changed (Inductor config, CUDA, device or Python)")
    for field in sorted(set(new.get("config", {})) | set(old.get("config", {}))):
        a, b = old.get("config", {}).get(field), new.get("config", {}).get(field)
        if a != b:
            lines.append(f"config field {field}: {a!r} -> {b!r}")
    for var in sorted(set(new.get("env", {})) | set(old.get("env", {}))):
        if new.get("env", {}).get(var) != old.get("env", {}).get(var):
            lines.append(f"environment {var}: {old['env'].get(var)!r} -> {new['env'].get(var)!r}")
    lines.extend(_source_differences(new, old, new_sources or {}, old_sources or {}))
    if new.get("graph") != old.get("graph") and not lines:
        lines.append("traced graph: the model's structure or parameter shapes changed")
    return lines


def _source_differences(
    new: Mapping[str, Any], old: Mapping[str, Any], new_text: Mapping[str, str], old_text: Mapping[str, str]
) -> list[str]:
    def by_name(factors: Mapping[str, Any]) -> dict[str, str]:
        return {key.rsplit("@", 1)[0]: sha for key, sha in factors.get("sources", {}).items()}

    lines = []
    a, b = by_name(old), by_name(new)
    for name in sorted(set(a) | set(b)):
        if name not in a:
            lines.append(f"source file {name}: newly traced")
        elif name not in b:
            lines.append(f"source file {name}: no longer traced")
        elif a[name] != b[name]:
            lines.append(
                f"source file {name}: content changed{_diff_summary(old_text.get(name), new_text.get(name))}"
            )
    return lines


def _diff_summary(old: str | None, new: str | None) -> str:
    if old is None or new is None:
        return ""
    diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    first = next((line for line in diff if line.startswith("@@")), "")
    changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")][:4]
    shown = "; ".join(line.strip()[:80] for line in changed)
    return f" (+{added}/-{removed} lines, first hunk {first}: {shown})"


def entry_key_of(path: Path) -> KeyRecord | None:
    """The key record of the entry at ``path``, from its factors file; None if unreadable."""
    try:
        data = json.loads((path / FACTORS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return entry_key(data) if isinstance(data, dict) else None


def _load_factors(path: Path) -> dict[str, Any] | None:
    record = entry_key_of(path)
    return dict(record.factors) if record is not None else None


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
    record = entry_key_of(target)
    if record is None:
        return [f"{target}: no readable {FACTORS}"]
    new = dict(record.factors)
    key_lines = [record.debug_lines()[0]]
    if record.digest[:10] != target.parent.parent.name:
        key_lines.append(
            f"  (its {FACTORS} do not hash to this entry's key {target.parent.parent.name}: the file "
            "was edited or the entry copied; the differences below may not be why it missed)"
        )
    candidates = [p for p in entries if p != target and _load_factors(p) is not None]
    same_prefix = [p for p in candidates if p.name == target.name] or candidates
    if not same_prefix:
        return [f"entry {target}", *key_lines, "the only entry: a first compile, nothing to compare with"]

    def distance(p: Path) -> int:
        return len(factor_differences(new, _load_factors(p) or {}))

    nearest = min(same_prefix, key=distance)
    old = _load_factors(nearest) or {}
    new_text = {k.rsplit("@", 1)[0]: v for k, v in _sources(target).items() if _in(k, new)}
    old_text = {k.rsplit("@", 1)[0]: v for k, v in _sources(nearest).items() if _in(k, old)}
    lines = [f"entry {target}", *key_lines, f"nearest existing entry {nearest}; differences:"]
    differences = factor_differences(new, old, new_text, old_text)
    lines.extend(f"  - {d}" for d in differences or ["(none: the entries have equal factors)"])
    return lines


def _in(snapshot_name: str, factors: dict[str, Any]) -> bool:
    return snapshot_name in factors.get("sources", {})
