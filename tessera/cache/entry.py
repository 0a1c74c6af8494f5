"""One model's entry in the cache: its directory, files, checksums, locks and in-use marker.

``<root>/<key[:10]>/rank_<r>_<dp>/<prefix>/`` holds index.py, cache_key_factors.json,
computation_graph.py, model_artifact.pkl, sources/ and artifacts/ (compiled pieces, by content).
Every write is atomic (temp file + ``os.replace``); index updates are serialised by a file lock
and batched: what a process records is written once when the entry is opened, once per compile
turn (``flush``) and once with the whole-model artifact, however many pieces it links.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import filelock

from tessera.cache import index as index_, liveness, trust
from tessera.cache.index import ArtifactRecord, FileRecord, Index, IndexKey
from tessera.cache.key import SourceFile, entry_key
from tessera.cache.refusal import Refused
from tessera.cache.root import root_path
from tessera.errors import CacheWarning

log = logging.getLogger(__name__)

INDEX = index_.FILE
FACTORS = "cache_key_factors.json"
GRAPH = "computation_graph.py"
MODEL = "model_artifact.pkl"
ARTIFACTS = "artifacts"
_WARNED: set[Path] = set()  # damaged files already reported by this process


class CacheDamagedWarning(CacheWarning):
    """A cache file was missing or damaged; tessera rebuilt what depended on it."""


def cache_root(configured: str | None) -> Path:
    """The root every model's entries live under: config, ``$TESSERA_CACHE_DIR``, or the user cache."""
    root = root_path(configured)
    liveness.register_root(root)  # this process's writer lock for files under it lives there
    return root


def rank_dir() -> str:
    """``rank_<r>_<dp>``: the rank from torch.distributed when it is initialised, else 0."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dp_rank = int(os.environ.get("TESSERA_DP_RANK", "0"))
    return f"rank_{rank}_{dp_rank}"


def entry_path(root: Path, key: str, prefix: str) -> Path:
    return root / key[:10] / rank_dir() / prefix


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a part.

    The temp file (``.<name>.<writer token>.<random>.tmp``, mode 0600 or the shared mode) is
    removed on any failure; ``tools.stray_temp_files`` finds those of killed processes by the
    writer lock its token names (see liveness.py).
    """
    trust.make_dir(path.parent)
    token = liveness.writer_token(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{token}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if trust.shared_group():
            os.chmod(tmp, trust.file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def report_damage(path: Path, problem: str) -> None:
    """Warn once per damaged file per process (a CacheDamagedWarning naming the file)."""
    if path in _WARNED:
        return
    _WARNED.add(path)
    warnings.warn(f"tessera cache: {path} is {problem}; rebuilding it", CacheDamagedWarning, stacklevel=4)


def check_file(base: Path, record: FileRecord) -> str | None:
    """None if ``record``'s file under ``base`` has the recorded size and checksum, else the problem."""
    if not record.file:
        return None
    path = base / record.file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != record.size:
        return f"{size} bytes where the index says {record.size}"
    try:
        if sha256_file(path) != record.sha256:
            return "checksum mismatch"
    except FileNotFoundError:  # removed since the stat above
        return "missing"
    return None


read_index = index_.read  # the entry's index (index.py owns reading and merging it)


class CacheEntry:
    """One model's directory in the cache, opened by this process."""

    def __init__(self, path: Path, factors: Mapping[str, Any], key: str | None = None) -> None:
        self.path = path
        self.key_record = entry_key(factors)  # its factors are cache_key_factors.json
        # The full digest; ``key`` only names an entry a test makes by hand (create and
        # open_existing key every entry by its factors).
        self.key = key if key is not None else self.key_record.digest
        self.index = Index(created=time.time())
        self.existed = False
        self._dirty = False  # self.index holds records not yet written (see flush)
        self._lock = filelock.FileLock(str(path / ".lock"))
        if len(path.parents) > 2:
            liveness.register_root(path.parents[2])  # <root>/<key10>/rank_<r>_<dp>/<prefix>
        # Files whose checksum this process verified, with the stat they had then: identical
        # layers share one file, which is hashed once per start, not once per layer.
        self._verified: dict[tuple[str, str], tuple[int, int, int]] = {}

    @classmethod
    def create(
        cls,
        root: Path,
        prefix: str,
        factors: Mapping[str, Any],
        graph_dump: str,
        sources: Sequence[SourceFile],
    ) -> CacheEntry | None:
        """Open (creating if needed) the entry for ``factors``; damaged side files are rewritten.

        None, after one CacheWarning, when the entry cannot be used: not writable (permissions,
        read-only, disk full, a file in the way) or not trusted (see trust.py).
        """
        key = entry_key(factors)
        path = entry_path(root, key.digest, prefix)
        try:
            trust.make_dir(path / ARTIFACTS)
            untrusted = trust.chain_problem(root, path)
            if untrusted is not None:
                trust.warn_once(untrusted.path, untrusted.why, "not using it; compiling without the cache")
                return None
            entry = cls(path, key.factors)
            entry._open(graph_dump, sources)
        except OSError as e:
            trust.warn_once(Path(e.filename or path), _cause(e), "compiling without the cache")
            return None
        return entry

    @classmethod
    def open_existing(cls, path: Path) -> CacheEntry | Refused:
        """Open an entry for a start without Dynamo; every file it vouches for is verified.

        ``Refused`` (after reporting damage) when it cannot be trusted.
        """
        if not path.is_dir():
            return Refused("it was removed")  # pruned or cleared: a plain miss
        untrusted = trust.chain_problem(path.parents[2], path) or _file_problem(path / MODEL)
        if untrusted is not None:
            trust.warn_once(untrusted.path, untrusted.why, "not loading it; compiling without the cache")
            return Refused(f"{untrusted.path} is {untrusted.why}")
        entry = cls(path, {}, path.parent.parent.name)  # keyed once its files are verified
        # Marked before anything is read: from here on no pruner removes a file we verify or load.
        if not entry._mark_in_use(wait=False):
            return Refused("it was removed, or cache prune or clear is removing it")  # a plain miss
        entry.existed = True
        problem = entry._load_index()
        if problem is not None:
            entry.report_damage(INDEX, problem)
            return Refused(f"its index is {problem}")
        if not {FACTORS, GRAPH} <= set(entry.index.files):
            return Refused("it was not finished by the process that made it")
        for name, sha in sorted(entry.index.files.items()):
            try:
                actual: str | None = sha256_file(path / name)
            except FileNotFoundError:
                actual = None
            if actual != sha:
                problem = "missing" if actual is None else "content does not match its key"
                entry.report_damage(name, problem)
                return Refused(f"{name} is {problem}")
        try:
            factors = json.loads((path / FACTORS).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            return Refused(f"{FACTORS} is unreadable ({type(e).__name__})")
        key = entry_key(factors) if isinstance(factors, dict) else None
        if key is None or key.digest[:10] != path.parent.parent.name:
            return Refused(f"{FACTORS} does not hash to the key it is filed under")
        entry.key_record, entry.key = key, key.digest
        return entry

    # -- opening -------------------------------------------------------------------------------
    def _open(self, graph_dump: str, sources: Sequence[SourceFile]) -> None:
        # Marked before anything is read or written. A pruner removing this entry right now is
        # waited for; then the entry is made afresh (our work lands in it, not in the trash).
        for _ in range(10):
            trust.make_dir(self.path / ARTIFACTS)
            if self._mark_in_use(wait=True):
                break
        else:
            raise OSError(
                errno.EBUSY, "removed by cache prune or clear each time it was made", str(self.path)
            )
        # Under the entry's lock: a process opening the entry at the same time waits, then finds
        # the index and the side files it vouches for, written together (one index write). So a
        # missing index beside side files is damage, never another process's half-made entry.
        with self._locked_if_possible():
            self.existed = (self.path / FACTORS).exists() or (self.path / INDEX).exists()
            self._read_or_reset_index()
            factors_text = json.dumps(self.key_record.factors, indent=2, sort_keys=True) + "\n"
            self._ensure_file(FACTORS, factors_text.encode())
            self._ensure_file(GRAPH, graph_dump.encode())
            for source in sources:  # snapshots for `cache explain`, checked like every other file
                with contextlib.suppress(OSError):
                    content = Path(source.path).read_bytes()
                    if hashlib.sha256(content).hexdigest() == source.sha256:
                        self._ensure_file(f"sources/{Path(source.path).name}@{source.sha256[:12]}", content)
            self.flush()

    def _read_or_reset_index(self) -> None:
        problem = self._load_index()
        if problem is None:
            return
        if self.existed:
            self.report_damage(INDEX, problem)
        self.index = Index(created=time.time())  # written by _open's flush
        self._dirty = True

    def _load_index(self) -> str | None:
        """Read the index; return the problem if it cannot be trusted."""
        try:
            self.index = read_index(self.path)
        except FileNotFoundError:
            return "missing"
        except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as e:
            return f"unreadable ({type(e).__name__}: {str(e)[:80]})"
        return None

    def _ensure_file(self, name: str, expected: bytes) -> None:
        path = self.path / name
        try:
            actual = path.read_bytes()
        except FileNotFoundError:
            actual = None
        digest = hashlib.sha256(expected).hexdigest()
        if actual == expected:
            if self.index.files.get(name) != digest:
                self._record_file(name, digest)
            return
        # Damage only where the index vouches for the file: another process may be creating this
        # entry right now, and a file it has not written yet is not a damaged one.
        if self.index.files.get(name) is not None:
            self.report_damage(name, "missing" if actual is None else "content does not match its key")
        atomic_write(path, expected)
        self._record_file(name, digest)

    def _record_file(self, name: str, digest: str) -> None:
        self.index.files[name] = digest
        self._dirty = True

    def _mark_in_use(self, *, wait: bool) -> bool:
        """Mark the entry in use for the life of the process (see ``liveness.mark_in_use``)."""
        return liveness.mark_in_use(self.path, wait=wait)

    @contextlib.contextmanager
    def _locked_if_possible(self) -> Iterator[None]:
        """The entry's lock, or none on a read-only cache (where nobody else can write either)."""
        try:
            self._lock.acquire()
        except OSError:
            yield
            return
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.contextmanager
    def _updating_index(self) -> Iterator[None]:
        """Change ``self.index`` under the lock, merged with what other processes recorded, and
        write it (with every record not yet written) once."""
        with self._lock:
            self.index = index_.merged_with_file(self.index, self.path)
            yield
            self._write_index()

    def flush(self) -> None:
        """Write what this process recorded since the last write, merged under the lock with what
        other processes recorded: one atomic write however many records (OSError if it fails)."""
        if self._dirty:
            with self._updating_index():
                pass

    def _write_index(self) -> None:
        atomic_write(self.path / INDEX, self.index.format().encode())
        self._dirty = False

    # -- artifacts -----------------------------------------------------------------------------
    def reload(self) -> None:
        """Read the index again (other processes, or a fetch from the remote tier, added to it)."""
        self.index = index_.merged_with_file(self.index, self.path)

    def record_artifact(self, key: IndexKey, written: str, content: str) -> ArtifactRecord:
        """Move a freshly written artifact to its content address and record it in the index
        (written by the next ``flush``: the artifact is complete on disk before it is vouched for).

        ``written`` is the file the compiler wrote (relative to the entry); "" records an
        artifact with nothing on disk (the eager compiler's).
        """
        if written:
            source = self.path / written
            try:
                sha = sha256_file(source)
                relative = f"{ARTIFACTS}/{sha[:32]}.bin"
                size = source.stat().st_size
                os.replace(source, self.path / relative)
            except OSError:
                with contextlib.suppress(OSError):
                    source.unlink()  # never leave a scratch file behind
                raise
            record = ArtifactRecord(relative, sha, size, content)
        else:
            record = ArtifactRecord("", "", 0, content)
        self.index.entries[key] = record
        self._dirty = True
        return record

    def link_artifacts(self, records: Mapping[IndexKey, ArtifactRecord]) -> None:
        """Record that each key is served by an artifact already in the entry (an identical
        piece, or one taken from a sibling rank); written by the next ``flush``."""
        self.index.entries.update(records)
        self._dirty = True

    def check(self, record: FileRecord) -> str | None:
        """``check_file``, hashing each unchanged file at most once in this process."""
        if not record.file:
            return None
        try:
            st = (self.path / record.file).stat()
        except OSError:
            st = None
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns) if st is not None else None
        if stamp is not None and self._verified.get((record.file, record.sha256)) == stamp:
            return None
        problem = check_file(self.path, record)
        if problem is None and stamp is not None:
            self._verified[(record.file, record.sha256)] = stamp
        return problem

    @property
    def factors(self) -> Mapping[str, Any]:
        return self.key_record.factors

    def forget(self, key: IndexKey) -> None:
        self.index.entries.pop(key, None)

    def write_model(self, data: bytes) -> None:
        """Write the whole-model artifact and record it, together, under the entry's lock.

        Processes that trace the same model at once each write their own (equivalent) artifact;
        the lock keeps the file and the checksum in the index from two different writers.
        """
        with self._updating_index():
            atomic_write(self.path / MODEL, data)
            self.index.model = FileRecord(MODEL, hashlib.sha256(data).hexdigest(), len(data))

    def read_model(self) -> bytes | Refused:
        """The whole-model artifact's bytes, verified; ``Refused`` (reported) if damaged."""
        for attempt in range(2):
            record = self.index.model
            if record is None:
                return Refused("it holds no whole-model artifact")
            try:
                data = (self.path / MODEL).read_bytes()
            except FileNotFoundError:
                data = None
            if data is not None and hashlib.sha256(data).hexdigest() == record.sha256:
                return data
            if attempt == 0:
                # Another process may have replaced the artifact (and the index) since we read
                # the index: look again under the lock before calling it damage.
                with self._locked_if_possible():
                    self._load_index()
        problem = "missing" if data is None else "content does not match its key"
        self.report_damage(MODEL, problem)
        return Refused(f"{MODEL} is {problem}")

    def report_damage(self, name: str, problem: str) -> None:
        """Warn once per file per process; the caller rebuilds what the file held."""
        report_damage(self.path / name, problem)


def _cause(error: OSError) -> str:
    return error.strerror or type(error).__name__


def _file_problem(path: Path) -> trust.Untrusted | None:
    found = trust.problem(path)
    return None if found is None else trust.Untrusted(path, found)


def warn_write_failed(path: Path, error: OSError) -> None:
    """One CacheWarning per entry and cause: the model keeps running on what is in memory."""
    trust.warn_once(path, _cause(error), "the model runs without that part of the cache")
