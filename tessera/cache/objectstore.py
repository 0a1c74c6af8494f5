"""The remote tier's store in an object store: S3 or anything that speaks S3 (``s3://bucket/prefix``),
Google Cloud Storage (``gs://``) or a directory every replica mounts (``file://``), through obstore
(``pip install 'tessera[objectstore]'``).

Blobs are named by their sha256 and written only when absent (``If-None-Match: *``), so one is
never overwritten; a PUT is atomic (S3 and GCS show an object whole or not at all; obstore writes
a file under a temporary name and renames it), and the manifest that names a blob is written after
it. Leases need no other service: a lease is an object taken by a conditional create, extended and
given back by a conditional write on the version read (``If-Match``), so two replicas never both
hold one. It expires when its holder stops extending it: a lease older than its time by the store's
own clock (the age of a probe object the replica writes), or unchanged for that long since this
replica first saw it, is taken over by a conditional write. No replica's clock is trusted.

Endpoint and credentials come from the environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_REGION``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...) as obstore reads them; with no AWS key in
the environment and boto3 installed, from boto3's usual sources (``~/.aws/credentials`` and
``config``, SSO, instance roles). Never from tessera's own files.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import os
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import filelock

from tessera import counters
from tessera.cache.blobstore import NAMESPACE
from tessera.cache.download import CHUNK_BYTES, Downloaded, write_stream
from tessera.errors import ConfigError

RELEASED = b"-"  # a lease given back: free for the next taker
_MAX_RETRIES = 64  # a safety net: the retry timeout (the fault budget) ends the attempts
_TRANSFER_SECONDS = 3600.0  # one request whole: a blob of gigabytes on a slow link


def _segment(part: str) -> str:
    quoted = quote(part, safe="")
    return "%2E" + quoted[1:] if quoted.startswith(".") else quoted


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


class _Once:
    """One attempt per call at this level: obstore tries again inside each call, within the time
    ``ObjectStore.limit`` gives it."""

    def call_with_retry(self, do: Any, fail: Any) -> Any:
        return do()


class ObjectStore:
    """``BlobStore`` on an object store. Keys ``tessera:v1:blob:<sha>`` are paths
    ``tessera/v1/blob/<sha>`` under the URL's prefix."""

    def __init__(self, url: str, timeout: float) -> None:
        try:
            import obstore
            from obstore import exceptions
        except ImportError as e:
            scheme = url.split("://", maxsplit=1)[0]
            raise ConfigError(
                f"cache_remote={scheme}://... needs obstore: pip install 'tessera[objectstore]'"
            ) from e
        self._ob = obstore
        self._exists_error = exceptions.AlreadyExistsError
        self._stale_error = exceptions.PreconditionError
        # ValueError: a path obstore refuses (none should reach it: see _path).
        self.errors: tuple[type[BaseException], ...] = (
            exceptions.BaseError,
            OSError,
            TimeoutError,
            ValueError,
        )
        self.transient: tuple[type[Exception], ...] = ()  # retried inside obstore
        self._url = url
        self._scheme = url.split("://", 1)[0]
        self._timeout = timeout
        self._local = Path(urlsplit(url).path) if self._scheme == "file" else None
        self._store = self._connect(timeout)
        self._nonce = uuid.uuid4().hex
        # Each lease body differs from the last (S3's version of an object is its content's MD5:
        # a renewal that wrote the same bytes would look, to a waiter, like no renewal at all).
        self._renewals = itertools.count(1)
        # A lease seen by this replica: its version, and when (monotonic) it would have been new.
        self._seen: dict[str, tuple[str, float]] = {}
        self._offset: datetime.timedelta | None = None  # the store's clock minus this process's

    def _connect(self, timeout: float) -> Any:
        from obstore.store import LocalStore, from_url

        if self._local is not None:
            return LocalStore(self._local, mkdir=True)
        # A connect and each read are bounded by the budget, not a whole transfer: a large blob
        # from a store that answers takes what it takes; one that stops answering is a fault.
        client: dict[str, Any] = {
            "connect_timeout": _seconds(timeout),
            "read_timeout": _seconds(timeout),
            "timeout": _seconds(_TRANSFER_SECONDS),
        }
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        if self._scheme == "s3" and endpoint.startswith("http://"):
            client["allow_http"] = True  # an endpoint named with http:// (a store on the LAN, a test)
        retry = {
            "max_retries": _MAX_RETRIES,
            "retry_timeout": _seconds(timeout),
            "backoff": {
                "init_backoff": _seconds(0.05),
                "max_backoff": _seconds(min(0.5, timeout / 4)),
                "base": 2,
            },
        }
        options: dict[str, Any] = {"client_options": client, "retry_config": retry}
        credentials = _boto3_credentials() if self._scheme == "s3" else None
        if credentials is not None:
            options["credential_provider"] = credentials
        return from_url(self._url, **options)

    @staticmethod
    def _path(key: str) -> str:
        """``tessera:v1:<kind>:<part>...`` as ``tessera/v1/<kind>/<part>/...``, each part quoted: a
        cache prefix may hold ``:``, ``/`` or be ``..``, none of which may make a path segment."""
        kind, *parts = key.removeprefix(NAMESPACE).split(":", 2)  # the last part: all the rest
        return "/".join(["tessera", "v1", kind, *(_segment(part) for part in parts)])

    # -- what FaultBudget needs --------------------------------------------------------------------
    def retrying(self, pause_cap: float) -> _Once:
        return _Once()

    def limit(self, seconds: float) -> None:
        if seconds < self._timeout and self._local is None:
            self._timeout = seconds
            self._store = self._connect(seconds)

    # -- requests (each one counted) ---------------------------------------------------------------
    def _read(self, path: str) -> tuple[bytes, dict[str, Any]] | None:
        """The object's bytes and metadata (its version: ``e_tag``), or None where there is none."""
        counters.bump("remote_requests")
        try:
            found = self._ob.get(self._store, path)
            return bytes(found.bytes()), dict(found.meta)
        except FileNotFoundError:  # obstore's NotFoundError
            return None

    def _write(self, path: str, body: bytes, mode: Any = None) -> None:
        counters.bump("remote_requests")
        counters.bump("remote_writes")
        # One PUT, never a multipart upload: conditional modes apply to single PUTs, and an
        # artifact is far below S3's 5 GB limit for one.
        self._ob.put(self._store, path, body, mode=mode, use_multipart=False)

    def _landed(self, path: str, body: bytes) -> bool:
        """Whether the object now holds ``body``: a conditional write refused may be the retry of
        one that landed (obstore retries a dropped connection), and a lease body is never
        written twice."""
        found = self._read(path)
        return found is not None and found[0] == body

    def _create(self, path: str, body: bytes) -> bool:
        """Write ``body`` where there is no object yet (``If-None-Match: *``); whether it was."""
        try:
            self._write(path, body, "create")
            return True
        except self._exists_error:
            return self._landed(path, body)

    def _head(self, path: str) -> dict[str, Any] | None:
        counters.bump("remote_requests")
        try:
            return dict(self._ob.head(self._store, path))
        except FileNotFoundError:
            return None

    # -- blobs, manifests, pointers ----------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        found = self._read(self._path(key))
        return None if found is None else found[0]

    def download(self, key: str, target: Path) -> Downloaded | None:
        counters.bump("remote_requests")
        try:
            found = self._ob.get(self._store, self._path(key))
        except FileNotFoundError:  # obstore's NotFoundError
            return None
        return write_stream(target, found.stream(min_chunk_size=CHUNK_BYTES))

    def put(self, key: str, value: bytes) -> None:
        self._write(self._path(key), value)

    def add(self, key: str, value: bytes) -> None:
        """Write ``value`` unless the key exists (then the object there is left as it is)."""
        path = self._path(key)
        try:
            self._write(path, value, "create")
        except self._exists_error:
            # Refused: there, or (S3's 409) another write of it under way, which may never end.
            # Under its content's name the same bytes again replace nothing.
            if self._head(path) is None:
                self._write(path, value)

    def exists(self, key: str) -> bool:
        return self._head(self._path(key)) is not None

    # -- leases ------------------------------------------------------------------------------------
    def _token(self, value: bytes) -> bytes:
        # A new body at each renewal: its version changes, which tells waiters the holder lives.
        return value + b" " + f"{self._nonce}.{next(self._renewals)}".encode()

    def _replace(self, path: str, meta: dict[str, Any], body: bytes) -> bool:
        """Write ``body`` if the object is still the version ``meta`` describes."""
        if self._local is None:
            version: Any = {"e_tag": meta["e_tag"]}  # obstore's UpdateVersion
            if meta.get("version") is not None:
                version["version"] = meta["version"]  # GCS matches on the generation
            try:
                self._write(path, body, version)
                return True
            except (self._stale_error, self._exists_error, FileNotFoundError):
                return body != RELEASED and self._landed(path, body)
        # obstore's local store has no conditional overwrite: the same check and write, under a
        # lock beside the object that every replica on the mount takes.
        with filelock.FileLock(str(self._local / f"{path}.lock"), timeout=self._timeout):
            now = self._read(path)
            if now is None or now[1].get("e_tag") != meta.get("e_tag"):
                return False
            self._write(path, body)
            return True

    def _store_now(self) -> datetime.datetime | None:
        """The store's clock now: measured once (a probe object of this process's, written, read
        and removed), then this process's clock plus the offset found (skew cancels out)."""
        if self._offset is None:
            probe = f"tessera/v1/clock/{self._nonce}"
            before = datetime.datetime.now(datetime.timezone.utc)
            self._write(probe, b"")
            written = self._head(probe)
            if written is None:  # gone at once (a store restarting): no clock to be had
                return None
            counters.bump("remote_requests")
            self._ob.delete(self._store, probe)
            self._offset = written["last_modified"] - before
        return datetime.datetime.now(datetime.timezone.utc) + self._offset

    def _age(self, meta: dict[str, Any]) -> float:
        """Seconds since the object ``meta`` describes was written, by the store's clock."""
        now = self._store_now()
        return 0.0 if now is None else max(0.0, float((now - meta["last_modified"]).total_seconds()))

    def _expired(self, path: str, meta: dict[str, Any], ttl: float) -> bool:
        version = str(meta.get("e_tag"))
        seen = self._seen.get(path)
        clock = time.monotonic()
        if seen is None or seen[0] != version:
            # New to us: by the store's clock the first time, alive (just renewed) after that.
            age = self._age(meta) if seen is None else 0.0
            self._seen[path] = (version, clock - age)
            return age > ttl
        return clock - seen[1] > ttl

    def put_if_absent(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        # Read first, write only when the lease is there for the taking: waiters poll with GETs
        # (an S3 prefix takes about 5,500 a second; 3,500 PUTs), and a GET costs a tenth of a PUT.
        path = self._path(key)
        found = self._read(path)
        if found is None:
            return self._create(path, self._token(value))
        body, meta = found
        if body != RELEASED and not self._expired(path, meta, ttl_seconds):
            return False
        return self._replace(path, meta, self._token(value))

    def _owned(self, path: str, value: bytes) -> tuple[bytes, dict[str, Any]] | None:
        found = self._read(path)
        if found is None or found[0].split(b" ", 1)[0] != value:
            return None
        return found

    def renew(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        path = self._path(key)
        found = self._owned(path, value)
        return found is not None and self._replace(path, found[1], self._token(value))

    def delete_if(self, key: str, value: bytes) -> bool:
        # Given back by a conditional write, not a delete (S3 has no conditional delete on every
        # store): a taker's conditional write then succeeds at once.
        path = self._path(key)
        found = self._owned(path, value)
        return found is not None and self._replace(path, found[1], RELEASED)


def _boto3_credentials() -> Any:
    """With no AWS key in the environment, boto3's credential chain (config and credentials
    files, SSO, instance roles) when boto3 is installed; else None (obstore's own chain). Looked
    up once per process and environment: with nothing configured, boto3 asks the instance
    metadata service, which takes a second or two to say no."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    return _boto3_chain(*(os.environ.get(name) for name in _CREDENTIAL_VARIABLES))


_CREDENTIAL_VARIABLES = ("AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_ROLE_ARN")


@functools.lru_cache(maxsize=8)
def _boto3_chain(*environment: str | None) -> Any:
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:  # no boto3 (or Python 3.10, where obstore's provider cannot load)
        return None
    session = boto3.Session()
    if session.get_credentials() is None:
        return None  # nothing there either: obstore's chain (instance metadata, web identity)
    return Boto3CredentialProvider(session)


class LeasesApart:
    """``BlobStore`` with blobs, manifests and pointers in one store (an object store) and leases
    in another (Redis: ``cache_remote_leases``)."""

    def __init__(self, blobs: Any, leases: Any) -> None:
        self.blobs = blobs
        self.leases = leases
        self.errors = (*blobs.errors, *leases.errors)
        self.transient = leases.transient
        self.get, self.put, self.add, self.exists = blobs.get, blobs.put, blobs.add, blobs.exists
        self.download = blobs.download
        self.put_if_absent, self.renew, self.delete_if = leases.put_if_absent, leases.renew, leases.delete_if

    def retrying(self, pause_cap: float) -> Any:
        return self.leases.retrying(pause_cap)  # the object store's faults pass through it

    def limit(self, seconds: float) -> None:
        self.blobs.limit(seconds)
        self.leases.limit(seconds)
