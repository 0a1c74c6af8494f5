"""Compiling an entry once: across the ranks of one machine, and across a fleet.

Ranks whose traced graphs are identical get entries with the same key (under their own
``rank_<r>`` directories). One compiles while holding a file lock next to them; the others then
take its artifacts from the sibling entry instead of compiling. Across machines the remote tier
does the same with a lease in the shared store.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import filelock

from tessera.cache import liveness
from tessera.cache.entry import FACTORS, CacheEntry, atomic_write, read_index, sha256_file, warn_write_failed
from tessera.cache.index import ArtifactRecord, IndexKey
from tessera.cache.remote import RemoteTier
from tessera.validation import env_seconds

log = logging.getLogger(__name__)


@contextlib.contextmanager
def compile_turn(entry: CacheEntry, needed: set[IndexKey], remote: RemoteTier | None) -> Iterator[None]:
    """While the block runs, this process is the one compiling ``entry``'s missing artifacts.

    Before it starts, whatever a sibling rank or the fleet already compiled is brought into the
    entry (and its index reloaded), so the block only compiles what nobody has.
    """
    wait = env_seconds("REMOTE_WAIT_SECONDS", 900.0)
    lock = filelock.FileLock(str(entry.path.parents[1] / f".compile-{entry.path.name}.lock"))
    try:
        lock.acquire(timeout=wait)
        locked = True
    except (filelock.Timeout, OSError) as e:  # read-only, or a sibling stuck: compile anyway
        log.info("compiling %s without waiting for sibling ranks (%s)", entry.path, e)
        locked = False
    try:
        # Whoever held the lock before us may have compiled what we need into this very entry
        # (processes sharing a rank directory): read the index again before deciding.
        entry.reload()
        if _missing(entry, needed):
            _take_from_siblings(entry)
        if remote is not None and _missing(entry, needed):
            name = entry.path.name
            remote.fetch(entry.path, entry.key, name, needed)
            entry.reload()  # a manifest that lacks some pieces still brings the others
            if _missing(entry, needed):
                with remote.compile_turn(entry.path, entry.key, name, needed) as ours:
                    entry.reload()
                    yield
                    if ours:
                        # Once, before the lease goes; and only when the entry on disk has every
                        # piece (a failed write leaves it without some: then nothing is published).
                        remote.publish(entry.path, entry.key, name, needed)
                return
        yield
    finally:
        if locked:
            lock.release()


@contextlib.contextmanager
def prefetch(entry: CacheEntry, needed: set[IndexKey], remote: RemoteTier | None) -> Iterator[None]:
    """Before the block: what a sibling rank or the fleet already compiled, brought into the entry,
    without waiting for anyone (no lock, no lease). For a trace whose pieces serve as traced until
    their artifacts are in: what is missing compiles later, in the background compile's own turn."""
    entry.reload()
    if _missing(entry, needed):
        _take_from_siblings(entry)
    if remote is not None and _missing(entry, needed):
        remote.fetch(entry.path, entry.key, entry.path.name, needed)
        entry.reload()
    yield


def _missing(entry: CacheEntry, needed: set[IndexKey]) -> bool:
    return not needed <= set(entry.index.entries)


def _take_from_siblings(entry: CacheEntry) -> None:
    """Record in ``entry`` the artifacts a sibling rank's entry of the same key holds.

    A sibling file that is gone or damaged is skipped; an entry this process cannot write
    (read-only, disk full) costs one warning. Either way, what was not taken gets compiled.
    """
    taken: dict[IndexKey, ArtifactRecord] = {}
    try:
        for sibling in sorted(entry.path.parents[1].glob(f"rank_*/{entry.path.name}")):
            if sibling == entry.path or not _same_key(sibling, entry.path):
                continue
            try:
                index = read_index(sibling)
            except (OSError, ValueError, SyntaxError):
                continue
            for key, record in index.entries.items():
                if key in entry.index.entries or key in taken:
                    continue
                if not record.file or _copied(sibling / record.file, entry.path / record.file, record.sha256):
                    taken[key] = record
        if taken:
            entry.link_artifacts(taken)
    except OSError as e:
        warn_write_failed(entry.path, e)
        return
    if taken:
        log.info("took %d artifact(s) for %s from a sibling rank's entry", len(taken), entry.path)


def _copied(source: Path, target: Path, sha256: str) -> bool:
    """``target`` holds ``source``'s bytes (a hard link, else a copy), if they hash to ``sha256``."""
    if target.exists():
        return True
    try:
        if sha256_file(source) != sha256:
            return False
    except OSError:  # the sibling entry was pruned meanwhile
        return False
    tmp = target.with_name(f".{target.name}.{liveness.writer_token(target.parent)}.link.tmp")
    try:
        os.link(source, tmp)
    except OSError:  # another filesystem, or no hard links there: a copy
        atomic_write(target, source.read_bytes())
        return True
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return True


def _same_key(a: Path, b: Path) -> bool:
    try:
        return sha256_file(a / FACTORS) == sha256_file(b / FACTORS)
    except OSError:
        return False
