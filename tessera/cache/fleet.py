"""What a process exchanges with the fleet's store around one model: before a warm start, the
pointer and its entry fetched into the local cache (``fetch_pointer``); after a trace, the entry
and the pointer published (``publish``); and the local root and the tier a config names
(``cache_places``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.cache import trust
from tessera.cache.blobstore import (
    BlobStore,
    RedisStore,
    display,
    fault,
    warn_fault,
)
from tessera.cache.objectstore import LeasesApart, ObjectStore
from tessera.cache.remote import RemoteTier, model_record
from tessera.config import counted_of
from tessera.errors import ConfigError
from tessera.validation import OBJECT_STORE_SCHEMES, env_seconds

if TYPE_CHECKING:
    from tessera.config import CompileConfig


def fetch_pointer(remote: RemoteTier, root: Path, fingerprint: str) -> bool:
    """Before a warm start: bring the fleet's entry for ``fingerprint`` into the local cache;
    whether its pointer is now there, fetched (False: none in the fleet, or one already local)."""
    from tessera.cache import pointer

    if pointer.pointer_path(root, fingerprint).exists():
        return False
    body = remote.fetch_pointer(fingerprint)
    if body is None:
        return False
    entry = root / body["entry"]
    try:
        trust.make_dir(entry)
    except OSError as e:
        trust.warn_once(entry, e.strerror or str(e), "not keeping the remote entry locally")
        return False
    if not remote.fetch(entry, body["key"], body["prefix"], model=model_record(body.get("model"))):
        return False
    try:
        pointer.write_pointer(root, fingerprint, entry)
        learnt = body.get("learnt")
        if isinstance(learnt, list) and all(counted_of(s) is not None for s in learnt):
            pointer.write_learnt(root, fingerprint, entry, [c for c in map(counted_of, learnt) if c])
        plan = pointer.read_plan_of(body)  # checked again where traces.py reads it
        if plan:
            pointer.write_plan(root, fingerprint, plan)
    except OSError as e:
        trust.warn_once(root, e.strerror or str(e), "the fetched entry is not found by fingerprint")
    return pointer.pointer_path(root, fingerprint).exists()


def publish(
    remote: RemoteTier,
    root: Path,
    fingerprint: str,
    entry: Any,
    grown: bool = False,
    superseded: bool = False,
) -> None:
    """After a trace: publish the pointer from ``fingerprint`` to the entry, with the whole-model
    artifact and the sizes learnt for it; and the entry itself, unless it is in the store already
    (its lease holder published it before letting go, or this process fetched it): one manifest
    per compile, not two. ``grown``: the entry holds new pieces (a size learnt): published again.
    ``superseded``: a later trace widened this one: the entry is published (replicas may wait on
    its compile), the pointer is not. The store's pointer names one entry, the last published, and
    a superseded trace whose compiles end last would otherwise send every new replica to the
    narrow trace (the local pointer lists it first for the same reason, pointer.write_pointer)."""
    from tessera.cache import pointer

    key, prefix = entry.key, entry.path.name
    if (grown or not remote.holds(key, prefix)) and not remote.publish(entry.path, key, prefix):
        return
    if superseded:
        return
    relative = entry.path.relative_to(root).as_posix()
    learnt = pointer.read_learnt(root, fingerprint).get(entry.path, ())
    plan = pointer.read_plan(root, fingerprint)
    # Another replica published this fingerprint's pointer (the fleet traced it at once): one
    # read instead of a pointer and a whole-model artifact from every replica.
    if not grown and not learnt and not plan and remote.has_pointer(fingerprint, entry.path, relative):
        return
    remote.publish_pointer(fingerprint, entry.path, relative, key, prefix, learnt, plan)


@dataclass(frozen=True)
class CachePlaces:
    """Where a model's compiles are kept: the local root (None: the cache is off) and the fleet's
    remote tier behind it (None: none named, or the cache is off)."""

    root: Path | None
    remote: RemoteTier | None


def cache_places(config: CompileConfig) -> CachePlaces:
    """The one reading of a config's cache settings (``tessera.compile`` and the Dynamo backend)."""
    from tessera.cache.entry import cache_root

    root = None if config.disable_cache else cache_root(config.cache_dir)
    remote = remote_tier(config.cache_remote, config.cache_remote_leases) if root is not None else None
    return CachePlaces(root, remote)


def remote_tier(url: str | None, leases: str | None = None) -> RemoteTier | None:
    """The remote tier a config names (``cache_remote`` / ``TESSERA_CACHE_REMOTE``), or None; with
    ``leases`` (``cache_remote_leases``, a Redis URL), an object store's leases are held there."""
    if not url:
        return None
    if not url.startswith(OBJECT_STORE_SCHEMES):
        return RemoteTier(url)
    timeout = env_seconds("REMOTE_TIMEOUT_SECONDS", 5.0)
    try:
        store: BlobStore = ObjectStore(url, timeout)
    except ConfigError:
        raise
    except Exception as e:  # obstore refused it: a directory it cannot make, a URL it cannot use
        warn_fault(display(url), fault(display(url), "opening the store", e), "using the local cache only")
        return None
    if leases:
        store = LeasesApart(store, RedisStore(leases, timeout))
    return RemoteTier(url, store)
