"""Blobs fetched into a local entry (tessera/cache/download.py): at once, streamed, checked, and
nothing left behind whatever happens."""

from __future__ import annotations

import errno
import hashlib
import threading
from pathlib import Path

import pytest

from tessera.cache import download
from tessera.cache.download import Downloaded, LocalWriteError, staged_blobs, write_stream


def _blobs(count: int) -> dict[str, bytes]:
    return {f"piece_{i}/artifact.bin": bytes([i]) * (1000 + i) for i in range(count)}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _store(blobs: dict[str, bytes]) -> dict[str, bytes]:
    return {_sha(data): data for data in blobs.values()}


def _leftovers(entry: Path) -> list[Path]:
    return [p for p in entry.rglob("*") if p.is_file() and p.name.endswith(".tmp")]


def test_blobs_are_fetched_at_once_and_installed_only_when_asked(tmp_path):
    blobs = _blobs(12)
    store = _store(blobs)
    # Passes only when FETCH_THREADS fetches are in flight together: a serial fetch would time out
    # at the barrier and fail (BrokenBarrierError).
    barrier = threading.Barrier(download.FETCH_THREADS, timeout=30)
    calls = []

    def fetch(sha: str, target: Path) -> Downloaded:
        if len(calls) < download.FETCH_THREADS:
            calls.append(sha)
            barrier.wait()
        return write_stream(target, [store[sha][:10], store[sha][10:]])

    wanted = {name: _sha(data) for name, data in blobs.items()}
    with staged_blobs(tmp_path, wanted, fetch) as staging:
        assert staging.complete() and set(staging.staged) == set(blobs)
        assert staging.size == sum(map(len, blobs.values()))
        assert not any((tmp_path / name).exists() for name in blobs)  # staged, not in place yet
        for name in list(staging.staged)[:5]:
            staging.install(name)
    installed = [name for name in blobs if (tmp_path / name).exists()]
    assert len(installed) == 5 and all((tmp_path / n).read_bytes() == blobs[n] for n in installed)
    assert _leftovers(tmp_path) == []  # the seven not installed are gone


def test_a_missing_an_altered_and_an_unwritable_blob_are_told_apart(tmp_path):
    blobs = _blobs(4)
    store = _store(blobs)
    names = sorted(blobs)
    wanted = {name: _sha(data) for name, data in blobs.items()}
    gone, altered, unwritable = wanted[names[0]], wanted[names[1]], wanted[names[2]]

    def fetch(sha: str, target: Path) -> Downloaded | None:
        if sha == gone:
            return None
        if sha == unwritable:
            raise LocalWriteError(OSError(errno.ENOSPC, "No space left on device"))
        return write_stream(target, [b"not it" if sha == altered else store[sha]])

    with staged_blobs(tmp_path, wanted, fetch) as staging:
        assert not staging.complete()
        assert staging.missing == [names[0]] and staging.altered == [names[1]]
        assert staging.local_error is not None and staging.local_error.errno == errno.ENOSPC
        assert list(staging.staged) == [names[3]]
    assert _leftovers(tmp_path) == [] and not any((tmp_path / n).exists() for n in names)


def test_a_store_fault_midway_leaves_no_temp_file(tmp_path):
    def fetch(sha: str, target: Path) -> Downloaded:
        def chunks():
            yield b"part"
            raise ConnectionError("reset by peer")

        return write_stream(target, chunks())

    with pytest.raises(ConnectionError), staged_blobs(tmp_path, {"a.bin": "0" * 64}, fetch):
        pass
    assert _leftovers(tmp_path) == []


def test_write_stream_hashes_what_it_writes_and_a_retry_starts_again(tmp_path):
    target = tmp_path / "blob"
    write_stream(target, [b"x" * 100])
    got = write_stream(target, iter([b"ab", b"cd"]))  # a retried download: the file begins again
    assert target.read_bytes() == b"abcd" and got == Downloaded(_sha(b"abcd"), 4)
    with pytest.raises(LocalWriteError):
        write_stream(tmp_path / "missing-dir" / "blob", [b"x"])
