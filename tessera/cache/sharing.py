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
from tessera.cache.index import ArtifactRecord, IndexKey
from tessera.cache.remote import RemoteTier
from tessera.cache.store import FACTORS, CacheEntry, atomic_write, read_index, sha256_file, warn_write_failed
from tessera.validation import env_seconds

log = logging.getLogger(__name__)


@contextlib.contextmanager
def compile_turn(store: CacheEntry, needed: set[IndexKey], remote: RemoteTier | None) -> Iterator[None]:
    """While the block runs, this process is the one compiling ``store``'s missing artifacts.

    Before it starts, whatever a sibling rank or the fleet already compiled is brought into the
    entry (and its index reloaded), so the block only compiles what nobody has.
    """
    wait = env_seconds("REMOTE_WAIT_SECONDS", 900.0)
    lock = filelock.FileLock(str(store.path.parents[1] / f".compile-{store.path.name}.lock"))
    try:
        lock.acquire(timeout=wait)
        locked = True
    except (filelock.Timeout, OSError) as e:  # read-only, or a sibling stuck: compile anyway
        log.info("compiling %s without waiting for sibling ranks (%s)", store.path, e)
        locked = False
    try:
        # Whoever held the lock before us may have compiled what we need into this very entry
        # (processes sharing a rank directory): read the index again before deciding.
        store.reload()
        if _missing(store, needed):
            _take_from_siblings(store)
        if remote is not None and _missing(store, needed):
            name = store.path.name
            remote.fetch(store.path, store.key, name, needed)
            store.reload()  # a manifest that lacks some pieces still brings the others
            if _missing(store, needed):
                with remote.compile_turn(store.path, store.key, name, needed) as ours:
                    store.reload()
                    yield
                    if ours:
                        # Once, before the lease goes; and only when the entry on disk has every
                        # piece (a failed write leaves it without some: then nothing is published).
                        remote.publish(store.path, store.key, name, needed)
                return
        yield
    finally:
        if locked:
            lock.release()


def _missing(store: CacheEntry, needed: set[IndexKey]) -> bool:
    return not needed <= set(store.index.entries)


def _take_from_siblings(store: CacheEntry) -> None:
    """Record in ``store`` the artifacts a sibling rank's entry of the same key holds.

    A sibling file that is gone or damaged is skipped; an entry this process cannot write
    (read-only, disk full) costs one warning. Either way, what was not taken gets compiled.
    """
    taken: dict[IndexKey, ArtifactRecord] = {}
    try:
        for sibling in sorted(store.path.parents[1].glob(f"rank_*/{store.path.name}")):
            if sibling == store.path or not _same_key(sibling, store.path):
                continue
            try:
                index = read_index(sibling)
            except (OSError, ValueError, SyntaxError):
                continue
            for key, record in index.entries.items():
                if key in store.index.entries or key in taken:
                    continue
                if not record.file or _copied(sibling / record.file, store.path / record.file, record.sha256):
                    taken[key] = record
        if taken:
            store.link_artifacts(taken)
    except OSError as e:
        warn_write_failed(store.path, e)
        return
    if taken:
        log.info("took %d artifact(s) for %s from a sibling rank's entry", len(taken), store.path)


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
