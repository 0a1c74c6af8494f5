"""Blobs brought from the fleet's store into a local entry: several at once, each streamed to a
temp file beside its place (a file of gigabytes never whole in memory) while its sha256 is taken,
and put in place only once the caller has checked the lot (``Staging.install``); whatever is not
installed is removed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tessera.cache import liveness, trust

# Blobs fetched at once: an entry of hundreds of files is latency-bound on an object store (one
# GET each), and the threads mostly wait on sockets and disk, outside the GIL.
FETCH_THREADS = 8
CHUNK_BYTES = 8 << 20  # what one read of a stream asks for, and the most of a blob in memory


@dataclass(frozen=True)
class Downloaded:
    """A blob written to a local file: the sha256 of its bytes and how many there were."""

    sha256: str
    size: int


class LocalWriteError(Exception):
    """Writing a fetched blob to the local disk failed (full, read-only): not the store's fault,
    so never taken for one (a store's errors include OSError)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


def write_stream(target: Path, chunks: Iterable[bytes]) -> Downloaded:
    """Write ``chunks`` to ``target`` (truncated first: a retried download starts again), synced,
    hashing as they come."""
    digest = hashlib.sha256()
    size = 0
    with _local():
        f = open(target, "wb")  # noqa: SIM115 (closed below, its faults told from the store's)
    try:
        for chunk in chunks:  # the store's faults pass as they are
            digest.update(chunk)
            with _local():
                f.write(chunk)
            size += len(chunk)
        with _local():
            f.flush()
            os.fsync(f.fileno())
            f.close()  # a network filesystem may report a failed write only here
    finally:
        if not f.closed:
            with contextlib.suppress(OSError):
                f.close()
    return Downloaded(digest.hexdigest(), size)


@contextlib.contextmanager
def _local() -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise LocalWriteError(e) from e


# How a blob is fetched into a file: its sha256 and the file; None where the store lacks it.
Fetch = Callable[[str, Path], "Downloaded | None"]


@dataclass
class Staging:
    """The blobs of one fetch, in temp files until installed: ``staged`` (name to temp file, bytes
    checked), ``missing`` (names the store lacks), ``altered`` (names whose bytes did not match),
    ``local_error`` (the first local write that failed), ``size`` (bytes read)."""

    entry: Path
    staged: dict[str, Path] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    altered: list[str] = field(default_factory=list)
    local_error: OSError | None = None
    size: int = 0

    def complete(self) -> bool:
        return not (self.missing or self.altered or self.local_error)

    def install(self, name: str) -> None:
        """Put the staged blob ``name`` in place (atomically: readers see the old file or this)."""
        temp = self.staged.pop(name)
        if trust.shared_group():
            os.chmod(temp, trust.file_mode())
        os.replace(temp, self.entry / name)

    def discard(self) -> None:
        for temp in self.staged.values():
            with contextlib.suppress(OSError):
                temp.unlink()
        self.staged.clear()


@contextlib.contextmanager
def staged_blobs(entry: Path, wanted: dict[str, str], fetch: Fetch) -> Iterator[Staging]:
    """Fetch every blob of ``wanted`` (file name to sha256) at once into temp files beside their
    places under ``entry``; what the block does not install is removed when it ends."""
    staging = Staging(entry)
    try:
        if wanted:
            threads = min(FETCH_THREADS, len(wanted))
            with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tessera-fetch") as pool:
                futures = {pool.submit(_one, entry / name, sha, fetch): name for name, sha in wanted.items()}
                try:
                    for future in concurrent.futures.as_completed(futures):
                        _note(staging, futures[future], wanted[futures[future]], future.result())
                except BaseException:
                    # Every fetch ends before the pool does: the files of those not noted go too.
                    concurrent.futures.wait(futures)
                    for future in futures:
                        if not future.cancelled() and future.exception() is None:
                            temp, _ = future.result()
                            if temp is not None:
                                with contextlib.suppress(OSError):
                                    temp.unlink()
                    raise
        yield staging
    finally:
        staging.discard()


def _note(
    staging: Staging, name: str, sha: str, result: tuple[Path | None, Downloaded | OSError | None]
) -> None:
    temp, outcome = result
    if isinstance(outcome, OSError):
        staging.local_error = staging.local_error or outcome
    elif outcome is None:
        staging.missing.append(name)
    else:
        staging.size += outcome.size
        if outcome.sha256 == sha:
            assert temp is not None, "a download has a file"
            staging.staged[name] = temp
            return
        staging.altered.append(name)
    if temp is not None:
        with contextlib.suppress(OSError):
            temp.unlink()


def _one(target: Path, sha: str, fetch: Fetch) -> tuple[Path | None, Downloaded | OSError | None]:
    """One blob into a temp file named as atomic_write names its own (``tools.stray_temp_files``
    finds those of a process killed meanwhile)."""
    try:
        trust.make_dir(target.parent)
        token = liveness.writer_token(target.parent)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.{token}.", suffix=".tmp")
        os.close(fd)
    except OSError as e:
        return None, e
    temp = Path(name)
    try:
        return temp, fetch(sha, temp)
    except LocalWriteError as e:
        return temp, e.error
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
