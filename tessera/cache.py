"""The persistent cache: layout, the index file, atomic writes, checksums and self-healing.

``<root>/<key[:10]>/rank_<r>_<dp>/<prefix>/`` holds index.py, cache_key_factors.json,
computation_graph.py, sources/ (snapshots for ``cache explain``) and artifacts/ (by content).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import logging
import os
import pprint
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import filelock
import platformdirs

from tessera.cachekey import SourceFile

log = logging.getLogger(__name__)

INDEX = "index.py"
FACTORS = "cache_key_factors.json"
GRAPH = "computation_graph.py"
MODEL = "model_artifact.pkl"
INUSE = ".inuse"
INDEX_VERSION = 1
_HELD_OPEN: list[Any] = []  # in-use markers held (shared-locked) for the life of the process
_WARNED: set[Path] = set()  # damaged files already reported by this process


class CacheDamagedWarning(UserWarning):
    """A cache file was missing or damaged; tessera rebuilt what depended on it."""


def cache_root(configured: str | None) -> Path:
    """The root every model's entries live under: config, ``$TESSERA_CACHE_DIR``, or the user cache."""
    chosen = configured or os.environ.get("TESSERA_CACHE_DIR") or platformdirs.user_cache_dir("tessera")
    return Path(chosen).expanduser()


def rank_dir() -> str:
    """``rank_<r>_<dp>``: ranks from torch.distributed when it is initialised, else 0."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dp_rank = int(os.environ.get("TESSERA_DP_RANK", "0"))
    return f"rank_{rank}_{dp_rank}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def parse_index(text: str) -> dict[str, Any]:
    """The index as a dict, or ValueError. Literals only (``ast.literal_eval``), every key checked."""
    data = ast.literal_eval(text)
    if not isinstance(data, dict) or data.get("version") != INDEX_VERSION:
        raise ValueError("not a version-1 tessera index")
    entries = data.get("entries")
    if not isinstance(entries, dict):
        raise ValueError("'entries' is not a dict")
    for key, value in entries.items():
        if not (isinstance(key, tuple) and len(key) == 3):
            raise ValueError(f"entry key {key!r} is not (size, piece, compiler)")
        size, index, compiler = key
        size_ok = (
            size == "general"
            or (isinstance(size, int) and not isinstance(size, bool))
            or (
                isinstance(size, tuple)
                and len(size) == 2
                and isinstance(size[0], int)
                and (size[1] is None or isinstance(size[1], int))
            )
        )
        if not (size_ok and isinstance(index, int) and isinstance(compiler, str)):
            raise ValueError(f"entry key {key!r} has wrong types")
        if not (
            isinstance(value, dict)
            and isinstance(value.get("file"), str)
            and isinstance(value.get("sha256"), str)
            and isinstance(value.get("size"), int)
        ):
            raise ValueError(f"entry {key!r} lacks file/sha256/size")
        if Path(value["file"]).is_absolute() or ".." in Path(value["file"]).parts:
            raise ValueError(f"entry {key!r} points outside the cache entry")
    if not isinstance(data.get("created"), (int, float)):
        raise ValueError("'created' is missing")
    files = data.get("files", {})
    if not (
        isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        raise ValueError("'files' is not a dict of name -> sha256")
    model = data.get("model")
    if model is not None and not (
        isinstance(model, dict)
        and model.get("file") == MODEL
        and isinstance(model.get("sha256"), str)
        and isinstance(model.get("size"), int)
    ):
        raise ValueError("'model' record is malformed")
    return data


class CacheEntry:
    """One model's directory in the cache, opened for this process."""

    def __init__(self, path: Path, factors: Mapping[str, Any], key: str) -> None:
        self.path = path
        self.key = key
        self.factors = dict(factors)
        self.entries: dict[tuple[Any, int, str], dict[str, Any]] = {}
        self.created = time.time()
        self.existed = False
        self.model: dict[str, Any] | None = None
        self.files: dict[str, str] = {}
        self._lock = filelock.FileLock(str(path / ".lock"))

    # -- opening -------------------------------------------------------------------------------
    def open(self, graph_dump: str, sources: list[SourceFile]) -> None:
        """Create or check the entry; damaged side files are reported and rewritten."""
        self.existed = (self.path / FACTORS).exists() or (self.path / INDEX).exists()
        (self.path / "artifacts").mkdir(parents=True, exist_ok=True)
        self._mark_in_use()
        self._read_index()
        factors_text = json.dumps(self.factors, indent=2, sort_keys=True) + "\n"
        self._ensure_file(FACTORS, factors_text.encode())
        self._ensure_file(GRAPH, graph_dump.encode())
        for source in sources:  # snapshots for `cache explain`, checked like every other file
            with contextlib.suppress(OSError):
                content = Path(source.path).read_bytes()
                if hashlib.sha256(content).hexdigest() == source.sha256:
                    self._ensure_file(f"sources/{Path(source.path).name}@{source.sha256[:12]}", content)

    def _read_index(self) -> None:
        problem = self._load_index()
        if problem is None:
            return
        if self.existed:
            self.report_damage(INDEX, problem)
        with self._lock:
            # Another process may have written a good index since we looked: never clobber it.
            if self._load_index() is not None:
                self.entries = {}
                self._write_index()

    def _load_index(self) -> str | None:
        """Read the index into ``entries``; return the problem if it cannot be trusted."""
        try:
            data = parse_index((self.path / INDEX).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return "missing"
        except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError) as e:
            return f"unreadable ({type(e).__name__}: {str(e)[:80]})"
        self.entries = data["entries"]
        self.created = data["created"]
        self.model = data.get("model")
        self.files = data.get("files", {})
        return None

    def _ensure_file(self, name: str, expected: bytes) -> None:
        path = self.path / name
        try:
            actual = path.read_bytes()
        except FileNotFoundError:
            actual = None
        digest = hashlib.sha256(expected).hexdigest()
        if actual == expected:
            if self.files.get(name) != digest:
                self._record_file(name, digest)
            return
        # Damage only where the index vouches for the file: another process may be creating this
        # entry right now, and a file it has not written yet is not a damaged one.
        if self.files.get(name) is not None:
            self.report_damage(name, "missing" if actual is None else "content does not match its key")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, expected)
        self._record_file(name, digest)

    def _record_file(self, name: str, digest: str) -> None:
        self.files[name] = digest
        with self._lock:
            self._merge_from_disk()
            self.files[name] = digest
            self._write_index()

    def _mark_in_use(self) -> None:
        marker = self.path / INUSE
        try:
            import fcntl
        except ImportError:  # not POSIX: prune falls back to last-used times only
            marker.touch()
            return
        f = marker.open("a+b")
        with contextlib.suppress(OSError):
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.utime(marker)
        _HELD_OPEN.append(f)

    @classmethod
    def open_warm(cls, path: Path) -> CacheEntry | None:
        """Open an existing entry for a start without Dynamo; None (after reporting) if not sound.

        Every file the entry holds is checked against the sha256 the index records for it.
        """
        try:
            factors = json.loads((path / FACTORS).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            factors = None
        entry = cls(path, factors if isinstance(factors, dict) else {}, path.parent.parent.name)
        entry.existed = True
        problem = entry._load_index()
        if problem is not None:
            entry.report_damage(INDEX, problem)
            return None
        if not {FACTORS, GRAPH} <= set(entry.files):
            return None  # not finished by the process that made it: take the traced path
        for name in sorted(entry.files):
            try:
                actual = hashlib.sha256((path / name).read_bytes()).hexdigest()
            except FileNotFoundError:
                actual = "missing"
            if actual != entry.files.get(name):
                entry.report_damage(
                    name, "missing" if actual == "missing" else "content does not match its key"
                )
                return None
        problem = entry.check_model()
        if problem is not None:
            if problem != "not recorded":
                entry.report_damage(MODEL, problem)
            return None
        entry._mark_in_use()
        return entry

    # -- artifacts -----------------------------------------------------------------------------
    def read_index(self) -> dict[tuple[Any, int, str], str]:
        """Index key -> artifact file (relative to the entry), for the compiler manager."""
        return {key: value["file"] for key, value in self.entries.items()}

    def check_artifact(self, handle: str) -> str | None:
        """None if the artifact's bytes match the checksum recorded for it, else the problem."""
        record = next((v for v in self.entries.values() if v["file"] == handle), None)
        if record is None:
            return "not in the index"
        return self._check(record)

    def _check(self, record: Mapping[str, Any]) -> str | None:
        path = self.path / record["file"]
        if not path.exists():
            return "missing"
        if path.stat().st_size != record["size"]:
            return f"size {path.stat().st_size} bytes, index says {record['size']}"
        if sha256_file(path) != record["sha256"]:
            return "checksum mismatch"
        return None

    def adopt(self, key: tuple[Any, int, str], written: str) -> str:
        """Move a freshly written artifact to its content address and record it in the index.

        Returns the artifact's file name relative to the entry.
        """
        source = self.path / written
        sha = sha256_file(source)
        relative = f"artifacts/{sha[:32]}.bin"
        size = source.stat().st_size
        os.replace(source, self.path / relative)
        record = {"file": relative, "sha256": sha, "size": size}
        self.entries[key] = record
        with self._lock:
            # Merge with what other processes recorded since we read the index.
            self._merge_from_disk()
            self._write_index()
        return relative

    def _merge_from_disk(self) -> None:
        """Fold in what other processes recorded since we read the index (caller holds the lock)."""
        with contextlib.suppress(FileNotFoundError, ValueError, SyntaxError, UnicodeDecodeError):
            on_disk = parse_index((self.path / INDEX).read_text(encoding="utf-8"))
            self.entries = {**on_disk["entries"], **self.entries}
            self.created = min(self.created, on_disk["created"])
            self.files = {**on_disk.get("files", {}), **self.files}
            if self.model is None:
                self.model = on_disk.get("model")

    def record_model(self, sha: str, size: int) -> None:
        """Record the whole-model artifact (already written atomically) in the index."""
        self.model = {"file": MODEL, "sha256": sha, "size": size}
        with self._lock:
            self._merge_from_disk()
            self._write_index()

    def check_model(self) -> str | None:
        """None if the whole-model artifact matches its recorded checksum, else the problem."""
        if self.model is None:
            return "not recorded"
        return self._check(self.model)

    def forget(self, key: tuple[Any, int, str]) -> None:
        self.entries.pop(key, None)

    def _write_index(self) -> None:
        data: dict[str, Any] = {
            "version": INDEX_VERSION,
            "created": self.created,
            "entries": self.entries,
            "files": self.files,
        }
        if self.model is not None:
            data["model"] = self.model
        text = "# tessera cache index: a Python literal, read with ast.literal_eval.\n"
        text += pprint.pformat(data, width=100, sort_dicts=True) + "\n"
        atomic_write(self.path / INDEX, text.encode())

    def report_damage(self, name: str, problem: str) -> None:
        """Warn once per file per process; the caller rebuilds what the file held."""
        report_damage(self.path / name, problem)


def report_damage(path: Path, problem: str) -> None:
    """Warn once per damaged file per process (a CacheDamagedWarning naming the file)."""
    if path in _WARNED:
        return
    _WARNED.add(path)
    warnings.warn(f"tessera cache: {path} is {problem}; rebuilding it", CacheDamagedWarning, stacklevel=4)


@contextlib.contextmanager
def exclusive_if_unused(entry_dir: Path) -> Iterator[bool]:
    """Yield True while holding the entry exclusively (no process uses it), else False."""
    marker = entry_dir / INUSE
    try:
        import fcntl
    except ImportError:
        yield True
        return
    if not marker.exists():
        yield True
        return
    with marker.open("a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True


def open_entry(
    root: Path,
    prefix: str,
    factors: Mapping[str, Any],
    graph_dump: str,
    sources: list[SourceFile],
) -> CacheEntry:
    """Open (creating if needed) the entry for ``factors`` under ``root``."""
    from tessera.cachekey import compute_key

    key = compute_key(factors)
    entry = CacheEntry(root / key[:10] / rank_dir() / prefix, factors, key)
    entry.open(graph_dump, sources)
    return entry
