"""The stores behind the remote tier (Redis here, an object store in objectstore.py), and how
their faults are met: each failing call tried again after a pause, within one budget of
``TESSERA_REMOTE_TIMEOUT_SECONDS``, warned once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from tessera import counters
from tessera.cache.download import CHUNK_BYTES, Downloaded, write_stream
from tessera.errors import CacheWarning, ConfigError

log = logging.getLogger(__name__)

# A safety net under the budget, which is what ends the attempts (a dozen or so for 5 s).
_MAX_RETRIES = 64
NAMESPACE = "tessera:v1:"  # the remote tier's names: tessera:v1:<kind>:<parts>
_REPORTED: set[str] = set()  # stores whose fault this process has warned about: one warning each


class Retrying(Protocol):
    """How a store's client tries a call again (redis-py's ``Retry`` has this shape)."""

    def call_with_retry(self, do: Callable[[], Any], fail: Callable[[Exception], None]) -> Any: ...


class BlobStore(Protocol):
    """The few operations the remote tier needs from a store. ``put_if_absent``, ``renew`` and
    ``delete_if`` hold leases: a value with an expiry, which only its owner extends or drops."""

    # What the store raises when it cannot be reached or answer, and the part of that which may
    # pass (worth another attempt).
    errors: tuple[type[BaseException], ...]
    transient: tuple[type[Exception], ...]

    def retrying(self, pause_cap: float) -> Retrying:
        """The attempts of one call, pauses at most ``pause_cap`` seconds."""
        ...

    def get(self, key: str) -> bytes | None: ...

    def download(self, key: str, target: Path) -> Downloaded | None:
        """Stream the value into ``target`` (download.write_stream); None where there is none."""
        ...

    def put(self, key: str, value: bytes) -> None: ...

    def add(self, key: str, value: bytes) -> None:
        """Write ``value`` unless ``key`` exists (a blob, named by its content: never replaced)."""
        ...

    def exists(self, key: str) -> bool: ...

    def put_if_absent(self, key: str, value: bytes, ttl_seconds: float) -> bool: ...

    def renew(self, key: str, value: bytes, ttl_seconds: float) -> bool: ...

    def delete_if(self, key: str, value: bytes) -> bool: ...

    def limit(self, seconds: float) -> None:
        """Later operations give up after ``seconds`` (what is left of the fault budget)."""


class _Gone(Exception):
    """A blob evicted while it was read in ranges."""


class RedisStore:
    """``BlobStore`` on Redis (the ``redis`` client, ``pip install tessera[remote]``)."""

    # Compare-and-act on a lease without a race: only its owner may extend or drop it.
    _OWNED = "if redis.call('get', KEYS[1]) == ARGV[1] then return "
    _RENEW = _OWNED + "redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
    _DELETE = _OWNED + "redis.call('del', KEYS[1]) end return 0"

    def __init__(self, url: str, timeout: float) -> None:
        try:
            import redis  # noqa: F401
        except ImportError as e:
            raise ConfigError("cache_remote needs the redis client: pip install 'tessera[remote]'") from e
        self._url = url
        self._timeout = timeout
        self._client = self._connect(timeout)
        self.errors = store_errors()
        self.transient = transient_errors()

    def retrying(self, pause_cap: float) -> Retrying:
        from redis.backoff import EqualJitterBackoff
        from redis.retry import Retry

        backoff = EqualJitterBackoff(cap=pause_cap, base=0.05)
        retry: Retrying = Retry(backoff, _MAX_RETRIES, supported_errors=self.transient)
        return retry

    def _connect(self, timeout: float) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No retries inside redis-py: FaultBudget retries, within one budget for every call.
        # redis-py's own (3, with backoff, by default since redis-py 6; inside connect and again
        # around each command) have no overall limit. Keep this as long as FaultBudget retries.
        return redis.Redis.from_url(
            self._url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )

    @staticmethod
    def _count(writes: bool) -> None:
        counters.bump("remote_requests")
        if writes:
            counters.bump("remote_writes")

    def get(self, key: str) -> bytes | None:
        self._count(False)
        value = self._client.get(key)
        return value if isinstance(value, bytes) else None  # bytes: responses are not decoded

    def download(self, key: str, target: Path) -> Downloaded | None:
        self._count(False)
        length = int(self._client.strlen(key))
        if not length and not self.exists(key):
            return None

        def chunks() -> Iterator[bytes]:
            # Ranges of a blob, never replaced once written (named by its content).
            for start in range(0, length, CHUNK_BYTES):
                self._count(False)
                end = min(start + CHUNK_BYTES, length)
                chunk = self._client.getrange(key, start, end - 1)
                if len(chunk) != end - start:  # evicted meanwhile: a miss, not an altered blob
                    raise _Gone
                yield chunk

        try:
            return write_stream(target, chunks())
        except _Gone:
            return None

    def put(self, key: str, value: bytes) -> None:
        self._count(True)
        self._client.set(key, value)

    def add(self, key: str, value: bytes) -> None:
        self._count(True)
        self._client.set(key, value, nx=True)

    def exists(self, key: str) -> bool:
        self._count(False)
        return bool(self._client.exists(key))

    def put_if_absent(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        self._count(True)
        return bool(self._client.set(key, value, nx=True, px=int(ttl_seconds * 1000)))

    def renew(self, key: str, value: bytes, ttl_seconds: float) -> bool:
        self._count(True)
        return bool(self._client.eval(self._RENEW, 1, key, value, int(ttl_seconds * 1000)))

    def delete_if(self, key: str, value: bytes) -> bool:
        self._count(True)
        return bool(self._client.eval(self._DELETE, 1, key, value))

    def limit(self, seconds: float) -> None:
        if seconds < self._timeout:
            # A new client: socket timeouts are fixed when a connection is made.
            self._timeout = seconds
            self._client = self._connect(seconds)


def store_errors() -> tuple[type[BaseException], ...]:
    """What Redis raises when it cannot be reached or answer (RedisError, OSError)."""
    try:
        import redis

        return (redis.RedisError, OSError, TimeoutError)
    except ImportError:
        return (OSError, TimeoutError)


def transient_errors() -> tuple[type[Exception], ...]:
    """Redis's faults that may pass, worth another attempt: refused, reset, timed out, still
    loading after a restart (ConnectionError, BusyLoadingError, TimeoutError)."""
    try:
        import redis

        return (redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError)
    except ImportError:
        return (ConnectionError, TimeoutError)


def display(url: str) -> str:
    """``url`` as warnings and logs show it: never its password."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    return parts._replace(netloc=f"{host}:{parts.port}" if parts.port else host).geturl()


# The root cause obstore's Debug dump ends with (``message: "Connection refused"``), and the kind
# when no message is given (``kind: ConnectionRefused``).
_DUMP_MESSAGE = re.compile(r'\bmessage: "([^"\n]+)"')
_DUMP_KIND = re.compile(r"\bkind: (\w+)")
_SUMMARY_CHARS = 300


def fault_summary(error: BaseException) -> str:
    """A store's error as one readable line for a warning: its type, the first line of its message
    and, from a multi-line debug dump (obstore's ``Debug source:``), the root cause in brackets.
    The whole message goes to the DEBUG log where the fault is met."""
    text = str(error).strip()
    head, _, dump = text.partition("\n\nDebug source:")
    lines = [line.strip() for line in head.splitlines() if line.strip()]
    summary = " ".join(lines[0].split()) if lines else ""
    if len(lines) > 1 and not dump:
        dump = "\n".join(lines[1:])
    found = _DUMP_MESSAGE.findall(dump) or _DUMP_KIND.findall(dump)
    if found and found[-1] not in summary:
        summary = f"{summary} ({found[-1]})" if summary else found[-1]
    if len(summary) > _SUMMARY_CHARS:
        summary = summary[: _SUMMARY_CHARS - 3].rstrip() + "..."
    return f"{type(error).__name__}: {summary}" if summary else type(error).__name__


def fault(store: str, what: str, error: BaseException) -> str:
    """``what failed (the error in one line)``; the error's whole text logged at DEBUG."""
    log.debug("%s: %s failed: %s: %s", store, what, type(error).__name__, error)
    return f"{what} failed ({fault_summary(error)})"


def warn_fault(store: str, what: str, consequence: str) -> None:
    """One CacheWarning per store per process, however many calls fail: the first says what
    failed and what is done about it; later ones are logged."""
    if store in _REPORTED:
        log.info("%s: %s", store, what)
        return
    _REPORTED.add(store)
    warnings.warn(f"tessera cache: {store}: {what}; {consequence}", CacheWarning, stacklevel=2)


class FaultBudget:
    """Calls to a store, each tried again after a pause while it fails with a fault that may pass,
    within ``seconds`` in all for the life of the tier.

    The time every failed attempt and every pause took is spent from one budget, so a store that
    is down, hanging or restarting delays a first output by at most ``seconds``, however many
    calls fail. The store's client runs the attempts (redis-py's ``Retry`` with its equal-jitter
    exponential backoff; obstore's own retries inside each call); this class ends them when what
    is left could not pay for another pause, and shortens the store's timeouts so that no attempt
    outlives the budget.
    """

    def __init__(self, store_name: str, seconds: float, store: BlobStore) -> None:
        self.store_name = store_name
        self.seconds = seconds
        self.spent = 0.0
        self._spending = threading.Lock()
        self._store = store
        self._pause_cap = min(0.5, seconds / 4)  # restarts take about that: retry soon after
        self._retry = store.retrying(self._pause_cap)

    def left(self) -> float:
        return max(0.0, self.seconds - self.spent)

    def call(self, what: str, op: Callable[..., Any], *args: Any) -> Any:
        """``op(*args)``, tried again while it fails with a fault that may pass and the budget
        lasts; the last fault (or any other error) is raised."""
        start = time.monotonic()
        began = [start]  # when the latest attempt began: the time before it was lost to faults

        def attempt() -> Any:
            began[0] = time.monotonic()
            return op(*args)

        def failed(error: Exception) -> None:
            warn_fault(
                self.store_name,
                f"{what} failed ({type(error).__name__}: {error})",
                f"retrying for up to {self.seconds:g}s in all (TESSERA_REMOTE_TIMEOUT_SECONDS), "
                "then using the local cache only",
            )
            left = self.seconds - self.spent - (time.monotonic() - start)
            if left <= self._pause_cap:  # a pause and another attempt would overrun the budget
                raise error
            self._store.limit(left - self._pause_cap)

        try:
            return self._retry.call_with_retry(attempt, failed)
        except self._store.errors:  # the last attempt was lost to the store too
            began[0] = time.monotonic()
            raise
        finally:
            lost = began[0] - start
            with self._spending:  # blobs are fetched several at once (download.py)
                self.spent += lost
            if lost > 0:
                counters.bump("remote_fault_ms", round(lost * 1000))
