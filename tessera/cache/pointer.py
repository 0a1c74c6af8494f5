"""The warm pointer of a model fingerprint (``<root>/warm/<fingerprint>.json``): the cache
entries that hold its traces (each with why it was traced and its whole-model artifact's key), the
sizes learnt from traffic per entry, the trace plan (trace_plan.py), or the path the model runs on
instead (the guarded path). Written under a file lock, atomically; read defensively."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.cache.entry import atomic_write, report_damage
from tessera.cache.refusal import Refused
from tessera.cache.root import WARM_DIR
from tessera.config import Counted, counted_of


@dataclass(frozen=True)
class ListedTrace:
    """One trace a fingerprint leads to."""

    entry: Path  # the cache entry that holds it
    reason: str  # why the process that made it traced it
    model_sha: str  # its whole-model artifact's sha256 ("" for pointers written before it was kept)


@dataclass(frozen=True)
class OtherPath:
    """This fingerprint's model runs on a path without a whole-model artifact: ``"guarded"``
    (graph breaks). Recorded so that the next process goes there at once instead of failing the
    one-graph trace again."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"the model runs on the {self.path} path: {self.reason}"


def pointer_path(root: Path, fingerprint: str) -> Path:
    return root / WARM_DIR / f"{fingerprint[:32]}.json"


# The traces a fingerprint keeps, at most (the newest): a model holds up to CompileConfig.max_traces.
MAX_POINTER_ENTRIES = 16


def write_pointer(
    root: Path,
    fingerprint: str,
    entry_path: Path,
    reason: str = "the first call",
    model_sha: str = "",
    superseded: bool = False,
) -> None:
    """Add ``entry_path`` (one trace of the model, made because of ``reason``; its whole-model
    artifact's sha256) to the traces this fingerprint leads to, as the newest, or the oldest when
    ``superseded`` (a later trace widened it: a process adopts the newest that covers a call, and a
    superseded trace whose compiles ended last took the calls of the trace that widened it). Many
    processes may add at once: read, merge and replace under a lock."""
    from filelock import FileLock

    path = pointer_path(root, fingerprint)
    relative = entry_path.relative_to(root).as_posix()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        found = _read_entries(path)
        entries = [] if isinstance(found, (Refused, OtherPath)) else found
        entries = [e for e in entries if (e["entry"], e["model"]) != (relative, model_sha)]
        line = {"entry": relative, "reason": reason, "model": model_sha}
        entries = [line, *entries] if superseded else [*entries, line]
        old = _read_body(path)
        body: dict[str, Any] = {"entries": entries[-MAX_POINTER_ENTRIES:]}
        learnt = _learnt_of(old)
        if learnt:
            body["learnt"] = learnt
        if isinstance(old.get("plan"), dict):
            body["plan"] = old["plan"]
        atomic_write(path, json.dumps(body, indent=1).encode())


def write_plan(root: Path, fingerprint: str, plan: dict[str, list[Any]]) -> None:
    """Record what the model's traces found changing between calls (trace_plan.TracePlan, as JSON
    lists), merged with what other processes recorded: the next process traces a new kind of call
    with those dims dynamic at once, as this one would (automatic dynamic across processes)."""
    from filelock import FileLock

    path = pointer_path(root, fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        body = _read_body(path)
        if body.get("path") in PATHS or not body.get("entries"):
            return  # no trace to widen yet, or a model on the guarded path
        merged = read_plan_of(body)
        for key, items in plan.items():
            known = merged.setdefault(key, [])
            known.extend(item for item in items if item not in known)
        if merged != read_plan_of(body):
            atomic_write(path, json.dumps({**body, "plan": merged}, indent=1).encode())


def read_plan(root: Path, fingerprint: str) -> dict[str, list[Any]]:
    """What ``write_plan`` recorded for ``fingerprint`` (empty when nothing was)."""
    return read_plan_of(_read_body(pointer_path(root, fingerprint)))


def read_plan_of(body: dict[str, Any]) -> dict[str, list[Any]]:
    plan = body.get("plan")
    if not isinstance(plan, dict):
        return {}
    return {str(k): list(v) for k, v in plan.items() if isinstance(v, list)}


def write_learnt(root: Path, fingerprint: str, entry_path: Path, sizes: Sequence[Counted]) -> None:
    """Record the sizes learnt from traffic (compile_sizes="auto") for the trace in
    ``entry_path``, beside the traces the fingerprint leads to: the next process loads their
    artifacts at once. The last process to learn sets them (a fleet shares one record)."""
    from filelock import FileLock

    path = pointer_path(root, fingerprint)
    relative = entry_path.relative_to(root).as_posix()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        body = _read_body(path)
        if body.get("path") in PATHS:
            return  # a model on the guarded path keeps no whole-model artifact to load them with
        learnt: dict[str, list[Any]] = dict(_learnt_of(body))
        learnt[relative] = [s if isinstance(s, int) else list(s) for s in sizes]
        new = {"entries": body.get("entries", []), "learnt": learnt}
        if isinstance(body.get("plan"), dict):
            new["plan"] = body["plan"]
        atomic_write(path, json.dumps(new, indent=1).encode())


def read_learnt(root: Path, fingerprint: str) -> dict[Path, tuple[Counted, ...]]:
    """The sizes learnt for each trace's entry of ``fingerprint`` (empty when none were)."""
    out = {}
    for relative, sizes in _learnt_of(_read_body(pointer_path(root, fingerprint))).items():
        if not (Path(relative).is_absolute() or ".." in Path(relative).parts):
            out[root / relative] = tuple(sizes)
    return out


def _read_body(path: Path) -> dict[str, Any]:
    """A pointer file as JSON; {} when it is missing or unreadable (``_read_entries`` reports
    damage where it matters)."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _learnt_of(body: dict[str, Any]) -> dict[str, list[Counted]]:
    """The well-formed part of a pointer's learnt sizes: entry -> sizes (positive integers, or
    shapes: lists of them)."""
    learnt = body.get("learnt")
    if not isinstance(learnt, dict):
        return {}
    return {
        str(entry): [c for c in map(counted_of, sizes) if c is not None]
        for entry, sizes in learnt.items()
        if isinstance(sizes, list)
    }


PATHS = ("guarded",)


def write_path(root: Path, fingerprint: str, path: str, reason: str) -> None:
    """Record that this fingerprint's model runs on ``path`` (one of PATHS), and why."""
    atomic_write(pointer_path(root, fingerprint), json.dumps({"path": path, "reason": reason}).encode())


def _read_entries(path: Path) -> list[dict[str, str]] | Refused | OtherPath:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and data.get("path") in PATHS:
            return OtherPath(data["path"], str(data.get("reason", "")))
        if "entries" in data:
            entries = [
                {
                    "entry": str(e["entry"]),
                    "reason": str(e.get("reason", "")),
                    "model": str(e.get("model", "")),
                }
                for e in data["entries"]
            ]
        else:  # one trace, as written before a model held several
            entries = [{"entry": str(data["entry"]), "reason": "the first call", "model": ""}]
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:  # unreadable root: creating the entry will say so, once
        return Refused(f"{path} is not readable ({e.strerror})")
    except (ValueError, KeyError, TypeError) as e:
        report_damage(path, f"unreadable ({type(e).__name__})")
        return Refused(f"{path} is unreadable")
    return entries


def read_entries(root: Path, fingerprint: str) -> tuple[ListedTrace, ...] | Refused | OtherPath:
    """Every trace a fingerprint leads to, oldest first; or why the pointer cannot be used; or the
    path a model recorded to run on another path runs on."""
    path = pointer_path(root, fingerprint)
    found = _read_entries(path)
    if isinstance(found, (Refused, OtherPath)):
        return found
    out = []
    for item in found:
        relative = Path(item["entry"])
        if relative.is_absolute() or ".." in relative.parts:
            return Refused(f"{path} points outside the cache")
        out.append(ListedTrace(root / relative, item["reason"], item["model"]))
    return tuple(out)


def read_pointer(root: Path, fingerprint: str) -> Path | None:
    """The first trace's entry a fingerprint leads to; None if there is none (or it is unusable)."""
    found = read_entries(root, fingerprint)
    return found[0].entry if isinstance(found, tuple) and found else None
