"""The warm start: every trace of a model saved for the next process, and loaded by it.

``save`` writes one trace's whole-model artifact into its cache entry and adds the entry to the
traces its fingerprint leads to (``<root>/warm/<fingerprint>.json``, cache/artifact.py); ``load``
rebuilds every one of them without Dynamo. A trace that does not load here is skipped (counted,
and said once when it is not damage or a changed model); the others still serve.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera import counters
from tessera.backend import PiecewiseBackend
from tessera.cache import artifact as model_artifact
from tessera.cache.artifact import WarmStartUnavailable
from tessera.cache.entry import warn_write_failed
from tessera.cache.remote import RemoteTier, publish
from tessera.call_check import CallSpec
from tessera.compilers import make_compiler
from tessera.config import CompileConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavedTrace:
    """One trace rebuilt from its whole-model artifact."""

    backend: PiecewiseBackend
    call: Callable[..., Any]  # call(target, *args, **kwargs): Dynamo's bytecode, rebuilt
    spec: CallSpec
    reason: str  # why the process that made it traced it


def load(
    config: CompileConfig,
    root: Path,
    prefix: str,
    fingerprint: str,
    traced_fn: types.FunctionType,
) -> tuple[list[SavedTrace], str | None]:
    """Every saved trace of ``fingerprint`` that rebuilds here, and why the last one that did not
    was refused (None: all did, or there were none). Raises OtherPath for a model recorded to run
    on the guarded path, and CompilerError for a compiler whose loader fails on a sound file."""
    try:
        listed = model_artifact.read_entries(root, fingerprint)
    except model_artifact.OtherPath:
        raise
    except WarmStartUnavailable as e:
        counters.bump("warm_start_fallbacks")
        return [], str(e)
    learnt = model_artifact.read_learnt(root, fingerprint)
    saved: list[SavedTrace] = []
    refused = None if listed else "no whole-model artifact for this model yet"
    # Traces of one graph share an entry (and its pieces): each entry is rebuilt once.
    by_entry: dict[Path, list[tuple[str, str]]] = {}
    for entry_path, reason, key in listed:
        by_entry.setdefault(entry_path, []).append((key, reason))
    for entry_path, traces in by_entry.items():
        try:
            backend, calls = PiecewiseBackend.from_entry(
                config,
                make_compiler(config.backend),  # one per entry: a compiler writes into one entry
                root,
                prefix,
                entry_path,
                traced_fn,
                [key for key, _ in traces],
                learnt.get(entry_path, ()),
            )
        except WarmStartUnavailable as e:
            counters.bump("warm_start_fallbacks")
            refused = str(e)
            log.info("%s: a saved trace does not load (%s)", prefix, e)
            continue
        for key, reason in traces:
            if key in calls or (not key and len(calls) == 1):
                call, spec = calls[key] if key in calls else next(iter(calls.values()))
                saved.append(SavedTrace(backend, call, spec, reason))
    return saved, refused


def save(
    backend: PiecewiseBackend,
    root: Path,
    fingerprint: str,
    traced_fn: types.FunctionType,
    code: types.CodeType,
    spec: CallSpec,
    reason: str,
    remote: RemoteTier | None,
    plan: dict[str, list[Any]],
) -> None:
    """After a trace, once every size is compiled: its artifact, the fingerprint's pointer and
    the trace plan beside it, and with a remote tier all of them for the fleet."""
    saved = backend.save_artifact(fingerprint, traced_fn, code, spec, reason)
    save_plan(root, fingerprint, plan)  # after the pointer it goes in (an earlier trace's, if not saved)
    if saved and remote is not None and backend.entry is not None:
        publish(remote, root, fingerprint, backend.entry)


def save_sizes(root: Path, fingerprint: str, remote: RemoteTier | None, backend: PiecewiseBackend) -> None:
    """After a size is learnt or retired: the learnt sizes beside the fingerprint's traces (and,
    with a remote tier, the entry's new artifacts and the pointer), for the next process."""
    entry = backend.entry
    if entry is None:
        return
    try:
        model_artifact.write_learnt(root, fingerprint, entry.path, backend.learning.learnt_sizes)
    except OSError as e:  # the sizes serve here; the next process learns them again
        warn_write_failed(entry.path, e)
        return
    if remote is not None:
        publish(remote, root, fingerprint, entry, grown=True)


def save_plan(root: Path, fingerprint: str, plan: dict[str, list[Any]]) -> None:
    """What the model's traces found changing, for the next process (its new traces start wide)."""
    try:
        model_artifact.write_plan(root, fingerprint, plan)
    except OSError as e:  # the next process finds the dims again, a trace each
        log.debug("%s: trace plan not saved (%s)", fingerprint[:12], e)


def load_plan(root: Path, fingerprint: str) -> dict[str, list[Any]]:
    return model_artifact.read_plan(root, fingerprint)
