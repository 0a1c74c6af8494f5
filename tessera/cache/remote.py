"""The remote tier: a store shared by a fleet (Redis, or an object store: objectstore.py), behind
each process's local cache.

On a local miss an entry is fetched (manifest, then every file by sha256, each checked) into the
local cache; after a compile, the lease holder publishes what was made, once. Files are stored by
content, so replicas share identical pieces; the whole-model artifact travels with the pointer from
a model's fingerprint to its entry. When several processes miss pieces of the same entry at once,
one holds a lease (renewed while it compiles) and the others wait until a manifest has the pieces
they need; a compiler that dies lets its lease expire and a waiter takes over. With
``TESSERA_CACHE_SIGNING_KEY`` set, manifests and pointers are signed (HMAC-SHA256) and nothing
unsigned or wrongly signed is used. A failing store (unreachable, slow, restarted, evicting) is
retried within ``TESSERA_REMOTE_TIMEOUT_SECONDS`` in all and warned once (blobstore.py); then the
local cache carries on.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import filelock

from tessera import _compat, counters
from tessera.cache import trust
from tessera.cache.blobstore import (
    NAMESPACE,
    BlobStore,
    FaultBudget,
    RedisStore,
    display,
    fault,
    warn_fault,
)
from tessera.cache.download import Downloaded, staged_blobs
from tessera.cache.entry import INDEX, MODEL, atomic_write, read_index, sha256_file
from tessera.cache.index import FileRecord, Index, IndexKey, check_relative, parse
from tessera.config import Counted
from tessera.validation import env_seconds

log = logging.getLogger(__name__)

FORMAT = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
# A waiter's polls of the store: the first after 0.2 s, then 1.5 times longer each, up to 2 s.
_FIRST_POLL, _LAST_POLL = 0.2, 2.0


class FleetWaitAbandoned(Exception):
    """A process exiting stopped waiting for another replica's compile (nothing is compiled or
    loaded for it here; the lease holder publishes it for the next process)."""


class RemoteTier:
    """Fetch, publish, sign and lease cache entries in a shared store. Never raises: a failing
    store is retried within the timeout, warned about once, and then left alone."""

    def __init__(self, url: str, store: BlobStore | None = None) -> None:
        self.url = url
        self.name = display(url)  # without its password, for warnings and logs
        self.lease_seconds = env_seconds("REMOTE_LEASE_SECONDS", 30.0)
        self.wait_seconds = env_seconds("REMOTE_WAIT_SECONDS", 900.0)
        timeout = env_seconds("REMOTE_TIMEOUT_SECONDS", 5.0)
        self.store: BlobStore = store if store is not None else RedisStore(url, timeout)
        self.faults = FaultBudget(self.name, timeout, self.store)
        key = os.environ.get("TESSERA_CACHE_SIGNING_KEY")
        self.signing_key = key.encode() if key else None
        self.broken = False
        host = os.uname().nodename if hasattr(os, "uname") else "host"
        self.owner = f"{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Entries the store holds as this process has them (it published or fetched them), and
        # the last manifest merged for each with the pieces it left the entry with.
        self._in_store: set[tuple[str, str]] = set()
        self._altered: set[str] = set()  # blobs found in the store not matching their names
        self._first_model: dict[str, str] = {}  # fingerprint -> its whole-model artifact at first
        self._merged: dict[tuple[str, str], tuple[bytes, frozenset[IndexKey]]] = {}

    # -- plumbing ----------------------------------------------------------------------------------
    def _call(self, what: str, op: Any, *args: Any) -> Any:
        """``op(*args)`` on the store, retried within the fault budget; None once it failed for
        good (then the tier is off: the local cache carries on alone)."""
        if self.broken:
            return None
        try:
            return self.faults.call(what, op, *args)
        except self.store.errors as e:
            self.broken = True
            warn_fault(self.name, fault(self.name, what, e), "using the local cache only")
            log.info("%s: off after %.1fs lost to its faults; local cache only", self.name, self.faults.spent)
            return None

    def holds(self, key: str, prefix: str) -> bool:
        """Whether this process put the entry in the store or took it from there."""
        return (key, prefix) in self._in_store

    def _sign(self, body: bytes) -> str | None:
        return hmac.new(self.signing_key, body, hashlib.sha256).hexdigest() if self.signing_key else None

    def _wrap(self, body: dict[str, Any]) -> bytes:
        text = json.dumps(body, sort_keys=True)
        return json.dumps({"body": text, "sig": self._sign(text.encode())}).encode()

    def _unwrap(self, raw: bytes | None, what: str) -> dict[str, Any] | None:
        """The body of a signed record, or None (reported once when its signature is wrong)."""
        if raw is None:
            return None
        try:
            record = json.loads(raw)
            text, sig = record["body"], record.get("sig")
            body = json.loads(text)
        except (ValueError, KeyError, TypeError):
            trust.warn_once(Path(self.name), f"{what} is not a tessera record", "ignoring it")
            return None
        if self.signing_key is not None:
            expected = self._sign(text.encode())
            if not isinstance(sig, str) or not hmac.compare_digest(sig, expected or ""):
                trust.warn_once(
                    Path(self.name),
                    f"{what} is {'unsigned' if sig is None else 'signed with another key'}",
                    "not using it; compiling instead",
                )
                return None
        return body if isinstance(body, dict) else None

    # -- entries -----------------------------------------------------------------------------------
    def _entry_key(self, key: str, prefix: str) -> str:
        return f"{NAMESPACE}entry:{key}:{prefix}"  # no rank: identical graphs share, across ranks too

    def publish(self, entry: Path, key: str, prefix: str, needed: set[IndexKey] | None = None) -> bool:
        """Upload every file the entry's index vouches for (by sha256), then its manifest; with
        ``needed``, only when the entry on disk holds all of those pieces."""
        if self.broken:
            return False  # not a read of every file for nothing
        try:
            index = read_index(entry)
        except (OSError, ValueError, SyntaxError):
            return False
        if needed is not None and not needed <= set(index.entries):
            # A piece compiled here was never recorded (disk full, read-only): a manifest without
            # it would have the fleet load an entry that is not there and compile it regardless.
            log.info("not publishing %s/%s: a write of the local entry failed", key[:10], prefix)
            return False
        index.model = None  # the whole-model artifact travels with its pointer (publish_pointer)
        files = _file_checksums(index)
        for name, sha in files.items():
            if not self._upload(entry, name, sha):
                return False
        manifest = {"format": FORMAT, "key": key, "prefix": prefix, "files": files, "index": index.format()}
        self._call("publishing an entry", self.store.put, self._entry_key(key, prefix), self._wrap(manifest))
        if self.broken:
            return False
        self._in_store.add((key, prefix))
        return True

    def _upload(self, entry: Path, name: str, sha: str) -> bool:
        """The file as a blob named by its sha256 (unless the store has it); False if it changed."""
        blob = f"{NAMESPACE}blob:{sha}"
        altered = sha in self._altered
        if not altered and self._call("checking a blob", self.store.exists, blob):
            return True
        try:
            data = (entry / name).read_bytes()
        except OSError:
            return False
        if hashlib.sha256(data).hexdigest() != sha:
            return False  # changed under us: never publish what the index does not vouch for
        # Written only where absent: a blob is never replaced, except one this process found
        # altered (its bytes do not hash to its name), which these bytes, that do, repair.
        self._call("uploading a blob", self.store.put if altered else self.store.add, blob, data)
        if not self.broken:
            counters.bump("remote_bytes_written", len(data))
            self._altered.discard(sha)
        return True

    def fetch(
        self,
        entry: Path,
        key: str,
        prefix: str,
        needed: set[IndexKey] | None = None,
        model: FileRecord | None = None,
    ) -> bool:
        """Download an entry into the local cache, every file checked (and ``model``, the
        whole-model artifact a pointer names). True when the store has the entry and, given
        ``needed``, the local entry now holds all of those pieces: a manifest that lacks some is
        merged all the same, but those are still to be compiled, by the lease holder."""
        raw = self._call("fetching an entry", self.store.get, self._entry_key(key, prefix))
        if raw is None:
            return False
        merged_before = self._merged.get((key, prefix))
        if merged_before is not None and merged_before[0] == raw and model is None:
            return needed is None or needed <= merged_before[1]  # a waiter's poll: nothing new
        manifest = self._unwrap(raw, f"entry {key[:10]}/{prefix}")
        if manifest is None or (manifest.get("format"), manifest.get("key"), manifest.get("prefix")) != (
            FORMAT,
            key,
            prefix,
        ):
            return False  # another format, or a record replayed under another entry's name
        files = manifest.get("files")
        try:
            if not isinstance(files, dict):
                raise ValueError("'files' is not a dict")
            for name, sha in files.items():
                if not (isinstance(name, str) and isinstance(sha, str)):
                    raise ValueError(f"file {name!r}: not a name and a sha256")
                check_relative(name, f"file {name!r}")  # never a write outside the entry
            index = parse(str(manifest["index"]))
        except (ValueError, SyntaxError, KeyError) as e:
            trust.warn_once(
                Path(self.name), f"entry {key[:10]}/{prefix} is malformed ({e})", "compiling instead"
            )
            return False
        if model is not None:  # signed with the pointer, for this fingerprint: it wins
            index.model = model
            files = {**files, MODEL: model.sha256}
        wanted = {
            n: sha for n, sha in files.items() if not ((entry / n).exists() and sha256_file(entry / n) == sha)
        }
        with staged_blobs(entry, wanted, self._download) as staging:
            counters.bump("remote_bytes_read", staging.size)
            if staging.local_error is not None:
                trust.warn_once(entry, str(staging.local_error), "not keeping the remote entry locally")
                return False
            if staging.missing:
                log.info(
                    "remote entry %s/%s is incomplete (%s): compiling", key[:10], prefix, staging.missing[0]
                )
                return False  # evicted, or its upload never finished
            if staging.altered:
                self._altered.update(files[n] for n in staging.altered)  # the next publish repairs them
                trust.warn_once(
                    Path(self.name),
                    f"entry {key[:10]}/{prefix}: {', '.join(sorted(staging.altered))} do(es) not match the "
                    "sha256 the manifest names (altered in the store)",
                    "not using the entry; compiling instead",
                )
                return False
            try:
                # Under the entry's own lock, as every index update is; what the local index already
                # vouches for wins, and its files are left as they are.
                with filelock.FileLock(str(entry / ".lock"), timeout=60):
                    local = self._local_index(entry)
                    merged = local.merged_with(index) if local is not None else index
                    if staging.staged or merged != local:
                        vouched = _file_checksums(merged)
                        for name in list(staging.staged):
                            if vouched.get(name) == files[name]:
                                staging.install(name)
                        atomic_write(entry / INDEX, merged.format().encode())  # last: files first
            except OSError as e:
                trust.warn_once(entry, e.strerror or str(e), "not keeping the remote entry locally")
                return False
        pieces = frozenset(merged.entries)
        self._merged[(key, prefix)] = (raw, pieces)
        self._in_store.add((key, prefix))
        log.info("fetched entry %s/%s from %s (%d file(s))", key[:10], prefix, self.name, len(wanted))
        return needed is None or needed <= pieces

    def _download(self, sha: str, target: Path) -> Downloaded | None:
        """Blob ``sha`` streamed into ``target``, within the fault budget; None where the store
        lacks it, or has failed for good."""
        found: Downloaded | None = self._call(
            "fetching a blob", self.store.download, f"{NAMESPACE}blob:{sha}", target
        )
        return found

    @staticmethod
    def _local_index(entry: Path) -> Index | None:
        try:
            return read_index(entry)
        except (OSError, ValueError, SyntaxError):
            return None

    # -- pointers (model fingerprint -> entry and its whole-model artifact) --------------------------
    def publish_pointer(
        self,
        fingerprint: str,
        entry: Path,
        relative: str,
        key: str,
        prefix: str,
        learnt: Sequence[Counted] = (),
        plan: dict[str, list[Any]] | None = None,
    ) -> None:
        """The pointer from ``fingerprint`` to the entry, with its whole-model artifact, the sizes
        learnt from traffic for it (``learnt``) and the trace plan (which sizes its traces saw
        change, ``pointer.write_plan``): a replica that fetches it traces as this one would."""
        # The fingerprint is signed too: a pointer copied under another model's name is refused.
        if self.broken:
            return
        body: dict[str, Any] = {"entry": relative, "key": key, "prefix": prefix, "fingerprint": fingerprint}
        if learnt:
            body["learnt"] = [s if isinstance(s, int) else list(s) for s in learnt]
        if plan:
            body["plan"] = plan
        try:
            model = read_index(entry).model
        except (OSError, ValueError, SyntaxError):
            model = None
        if model is not None and self._upload(entry, MODEL, model.sha256):
            body["model"] = {"sha256": model.sha256, "size": model.size}
        self._call("publishing a pointer", self.store.put, f"{NAMESPACE}warm:{fingerprint}", self._wrap(body))

    def has_pointer(self, fingerprint: str, entry: Path, relative: str) -> bool:
        """Whether the store's pointer for ``fingerprint`` names the entry at ``relative`` with a
        whole-model artifact as good as the local one: not one found altered, and the local one
        is still what it was at this process's first trace (a later trace merges its variant in,
        and the fleet must get that; replicas' artifacts of the same first trace differ only in
        their bytes)."""
        try:
            local = read_index(entry).model
        except (OSError, ValueError, SyntaxError):
            return False
        if local is None or self._first_model.setdefault(fingerprint, local.sha256) != local.sha256:
            return False
        body = self.fetch_pointer(fingerprint)
        model = model_record(body.get("model")) if body is not None else None
        return (
            body is not None
            and body["entry"] == relative
            and model is not None
            and model.sha256 not in self._altered
        )

    def fetch_pointer(self, fingerprint: str) -> dict[str, Any] | None:
        raw = self._call("fetching a pointer", self.store.get, f"{NAMESPACE}warm:{fingerprint}")
        body = self._unwrap(raw, f"pointer {fingerprint[:12]}")
        if body is None or not all(isinstance(body.get(k), str) for k in ("entry", "key", "prefix")):
            return None
        if body.get("fingerprint") != fingerprint:
            why = f"pointer {fingerprint[:12]} names another model"
            trust.warn_once(Path(self.name), why, "not using it")
            return None
        relative = Path(body["entry"])
        if relative.is_absolute() or ".." in relative.parts:
            return None
        return body

    # -- compiling once across the fleet -----------------------------------------------------------
    @contextmanager
    def compile_turn(self, entry: Path, key: str, prefix: str, needed: set[IndexKey]) -> Iterator[bool]:
        """Yields True when this process should compile the ``needed`` pieces of the entry (it
        holds the lease, renewed until the block ends), False when another process published them
        while we waited (they are now in the local cache). A waiter whose compiler died, or that
        waited too long, compiles; so does every process once the store has failed.
        """
        lease_key = f"{NAMESPACE}lease:{key}:{prefix}"
        token = self.owner.encode()
        deadline = time.monotonic() + self.wait_seconds
        waiting = False
        pause = _FIRST_POLL
        while True:
            acquired = self._call(
                "taking a lease", self.store.put_if_absent, lease_key, token, self.lease_seconds
            )
            if acquired and self.fetch(entry, key, prefix, needed):
                # The previous holder published and let go between our last look and now.
                self._call("releasing a lease", self.store.delete_if, lease_key, token)
                yield False
                return
            if acquired or self.broken:
                break
            if self.fetch(entry, key, prefix, needed):
                yield False
                return
            if waiting and _compat.interpreter_exiting():
                # A process on its way out would wait (up to the whole wait) only to load what it
                # will never run: the holder publishes it for the next process all the same.
                log.info("exiting: not waiting for the fleet's compile of %s/%s", key[:10], prefix)
                raise FleetWaitAbandoned(f"{key[:10]}/{prefix}")
            if time.monotonic() > deadline:
                log.warning(
                    "waited %.0fs for another process to compile %s/%s; compiling here",
                    self.wait_seconds,
                    key[:10],
                    prefix,
                )
                break
            if not waiting:
                waiting = True
                log.info(
                    "another process is compiling %s/%s; waiting up to %.0fs",
                    key[:10],
                    prefix,
                    self.wait_seconds,
                )
            # Polls spaced out while the wait lasts, and spread: a thousand waiters started at once
            # would otherwise hit the store (and one lease's key) together, five times a second.
            time.sleep(pause * random.uniform(0.75, 1.25))
            pause = min(_LAST_POLL, pause * 1.5)
        if not acquired:
            yield True
            return
        stop = threading.Event()
        turn = threading.Lock()  # a renewal and the release, one at a time
        trouble: list[str] = []  # what befell the lease meanwhile, warned from this thread
        renewer = threading.Thread(
            target=self._renew, args=(lease_key, token, stop, turn, trouble), daemon=True
        )
        renewer.start()
        try:
            yield True
        finally:
            # The renewer is not joined: one hanging on a slow store must not delay the first
            # output past the budget. A renewal under way is waited for (within it), so that it
            # cannot take back the lease just given back.
            stop.set()
            waited = turn.acquire(timeout=max(0.1, self.faults.left()))
            try:
                if self._call("releasing a lease", self.store.delete_if, lease_key, token) is False:
                    trouble.append("its lease was gone when it was done compiling")
            finally:
                if waited:
                    turn.release()
            if trouble:
                warn_fault(
                    self.name,
                    f"entry {key[:10]}/{prefix}: {trouble[0]}",
                    "the store restarted, evicted it or could not be reached; another process may have "
                    "compiled the entry too (results are unaffected)",
                )

    def _renew(
        self, lease_key: str, token: bytes, stop: threading.Event, turn: threading.Lock, trouble: list[str]
    ) -> None:
        """Extend the lease while the block runs; one that vanished (a restart, an eviction) is
        taken again if nobody else has. Faults are only noted: this thread neither retries nor
        warns, and the next renewal is the retry."""
        while not stop.wait(self.lease_seconds / 3) and not self.broken:
            with turn:
                if stop.is_set():  # the block ended while this one waited: the lease is given back
                    return
                if not self._renew_once(lease_key, token, trouble):
                    return

    def _renew_once(self, lease_key: str, token: bytes, trouble: list[str]) -> bool:
        """One renewal; whether to go on renewing."""
        try:
            if self.store.renew(lease_key, token, self.lease_seconds):
                return True
            if not self.store.put_if_absent(lease_key, token, self.lease_seconds):
                trouble.append("its lease vanished while it compiled, and another process took it")
                return False
            trouble.append("its lease vanished while it compiled (taken again)")
        except self.store.errors as e:
            trouble.append(fault(self.name, "renewing its lease", e))
        return True


def _file_checksums(index: Index) -> dict[str, str]:
    """Every file an index vouches for: name -> sha256."""
    files = dict(index.files)
    for record in index.entries.values():
        if record.file:
            files[record.file] = record.sha256
    if index.model is not None:
        files[MODEL] = index.model.sha256
    return files


def model_record(value: Any) -> FileRecord | None:
    """The whole-model artifact a pointer names, or None (older pointers name none)."""
    if not isinstance(value, dict):
        return None
    sha, size = value.get("sha256"), value.get("size")
    if not (isinstance(sha, str) and _SHA256.fullmatch(sha) and isinstance(size, int) and size >= 0):
        return None
    return FileRecord(MODEL, sha, size)
