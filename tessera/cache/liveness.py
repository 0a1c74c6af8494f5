"""Who is using or writing a cache root right now, told by OS advisory locks that live processes
hold: the in-use marker of each entry and the writer lock of each process.

Pids are never the evidence: they are reused, and a cache volume shared by containers sees each
container's own pids. A lock is released by the kernel when its holder dies, wherever it ran.

- ``<entry>/.inuse``: every process using an entry holds a shared lock on it for its life.
  ``cache prune`` and ``clear`` remove an entry only while holding it exclusively, and move the
  entry out of its path before deleting it, so nobody can open a half-deleted entry.
- ``<root>/.writers/<token>``: every process that writes into a root holds this lock for its life
  and puts ``<token>`` in the names of its temp files (and of a pruner's trash), so a temp file
  whose token's lock nobody holds is the leftover of a writer that died.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

from tessera.cache import trust

try:
    import fcntl
except ImportError:  # not POSIX: no advisory locks (see each function for what it does instead)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

INUSE = ".inuse"
WRITERS = ".writers"
# A writer's token: its pid (for people reading a directory listing) and 48 random bits (what
# makes it unique across pid namespaces and pid reuse).
TOKEN = r"\d+-[0-9a-f]{12}"

_HELD_OPEN: list[int] = []  # in-use markers held (shared-locked) for the life of the process
_ROOTS: list[str] = []  # cache roots this process uses (absolute): writer locks live there
_WRITER_LOCKS: dict[str, int] = {}  # writer lock path -> descriptor held for the process's life
_TOKEN: list[str] = []  # this process's writer token, made on first use
# Two threads (a call writing its report, a background compile writing an artifact) must not both
# open and lock a new writer lock: flock conflicts between two descriptors of one process, so the
# second would wait forever on the first's.
_TOKEN_LOCK = threading.Lock()


def _forget_after_fork() -> None:
    """A forked child writes under a token of its own. The parent's descriptors it inherited stay
    open (they keep the parent's locks held while the child lives: never wrong, only late)."""
    _TOKEN.clear()
    _WRITER_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


# -- in-use markers ------------------------------------------------------------------------------
def mark_in_use(entry: Path, *, wait: bool) -> bool:
    """Hold a shared lock on ``entry``'s marker for the life of the process (prune skips it).

    False when the entry is gone: removed before it could be marked, or (``wait=False``) being
    removed by ``cache prune``/``clear`` right now. With ``wait=True`` this waits for such a
    removal to finish and then answers False: the caller creates the entry afresh. True also for
    an entry that cannot be marked (a read-only cache, one warning): nobody can remove it either.
    """
    marker = entry / INUSE
    if fcntl is None:  # prune falls back to last-used times only
        with contextlib.suppress(OSError):
            marker.touch()
        return entry.is_dir()
    try:
        # Opened for writing although a lock needs no write access: failing here is how a
        # read-only cache is told, and said once.
        fd = _open_lock(marker, os.O_RDWR | os.O_CREAT)
    except FileNotFoundError:
        return False  # the entry's directory was removed (or moved away by a pruner)
    except OSError as e:
        if not entry.is_dir():
            return False
        # A read-only cache (a baked image) still loads; nothing new will be saved to it.
        trust.warn_once(
            entry, e.strerror or type(e).__name__, "loading from it read-only; nothing new is saved there"
        )
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            # Only a pruner holds the marker exclusively, and only while it removes the entry.
            if not wait:
                os.close(fd)
                return False
            log.info("waiting for %s: cache prune or clear is removing it", entry)
            fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as e:  # a filesystem without locks (some NFS mounts): unprotected, as before
        log.debug("cannot lock %s (%s): prune may remove it while in use", marker, e)
    if not _same_file(fd, marker):
        os.close(fd)  # the pruner moved the entry away while we waited
        return False
    with contextlib.suppress(OSError):
        os.utime(fd)  # last used: prune removes least recently used entries first
    _HELD_OPEN.append(fd)
    return True


@contextlib.contextmanager
def exclusive_if_unused(entry: Path) -> Iterator[bool]:
    """Yield True while holding ``entry``'s marker exclusively (no process uses it), else False.

    A missing marker (an entry nobody opened yet, one brought in by ``cache import``) is created
    and locked like any other, so a process opening the entry meanwhile waits for the outcome.
    """
    if fcntl is None:
        yield True
        return
    marker = entry / INUSE
    try:
        fd = _open_lock(marker, os.O_RDONLY | os.O_CREAT)
    except OSError:  # gone already, or read-only (where nothing can be removed either)
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        # Another pruner may have moved this entry away between our open and our lock.
        yield _same_file(fd, marker)
    finally:
        os.close(fd)


def _open_lock(path: Path, flags: int) -> int:
    """A descriptor to lock ``path`` through; a file it creates gets the cache's file mode, so the
    other members of a shared cache's group can lock it too."""
    fd = os.open(path, flags | os.O_CLOEXEC, trust.file_mode())
    if flags & os.O_CREAT and trust.shared_group():
        with contextlib.suppress(OSError):  # the umask strips group bits; only the owner may restore them
            os.fchmod(fd, trust.file_mode())
    return fd


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed or replaced since)."""
    try:
        held, named = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


# -- writer locks --------------------------------------------------------------------------------
def register_root(root: Path) -> None:
    """Note that this process uses ``root``: its writer lock for files under it lives there."""
    path = os.path.abspath(root)
    if path not in _ROOTS:
        _ROOTS.append(path)


def registered_roots() -> tuple[str, ...]:
    """The cache roots this process uses (a compile worker takes its writer lock in them too)."""
    return tuple(_ROOTS)


def writer_token(directory: Path) -> str:
    """This process's token, for the name of a temp file about to be created in ``directory``.

    Before it returns, this process holds its writer lock in the cache root ``directory`` is in
    (or, for a directory under no root this process uses, or a root it may not write at its
    top, in ``directory`` itself): from the moment the temp file exists, ``cache clear`` can tell
    that its writer is alive. OSError if no lock can be made (no temp file could be either).
    """
    with _TOKEN_LOCK:
        return _writer_token(directory)


def _writer_token(directory: Path) -> str:
    if not _TOKEN:
        _TOKEN.append(f"{os.getpid()}-{secrets.token_hex(6)}")
    token = _TOKEN[0]
    here = os.path.abspath(directory)
    roots = [r for r in _ROOTS if here == r or here.startswith(r.rstrip(os.sep) + os.sep)]
    bases = list(dict.fromkeys([max(roots, key=len), here] if roots else [here]))
    for base in bases:
        lock = os.path.join(base, WRITERS, token)
        if lock in _WRITER_LOCKS:
            return token
        try:
            _WRITER_LOCKS[lock] = _hold_writer_lock(Path(lock))
        except OSError:
            if base == bases[-1]:
                raise
            continue
        return token
    raise AssertionError(f"no lock base for {directory}: {bases=}")


def _hold_writer_lock(lock: Path) -> int:
    if fcntl is None:  # without locks nobody can tell a dead writer: temp files are kept
        return -1
    for _ in range(100):
        trust.make_dir(lock.parent)
        fd = _open_lock(lock, os.O_RDONLY | os.O_CREAT)
        try:
            # Blocking: a `cache clear` probing this token holds it for an instant.
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no locks on this filesystem: we still write, unprotected
            return fd
        if _same_file(fd, lock):
            return fd
        os.close(fd)  # a `cache clear` removed it as a dead writer's before we locked it: again
    raise OSError(f"could not hold the writer lock {lock}")


def writer_alive(token: str, directory: Path, root: Path) -> bool:
    """Whether the process that named a temp file in ``directory`` with ``token`` still runs:
    someone holds ``<d>/.writers/<token>`` for ``directory`` or one of its parents up to ``root``.
    """
    if fcntl is None:
        return True
    for base in (directory, *directory.parents):
        if _lock_held(base / WRITERS / token):
            return True
        if base == root or root not in base.parents:
            break
    return False


def _lock_held(lock: Path) -> bool:
    # Our own locks answer like anyone's: flock conflicts between two descriptors of one process.
    try:
        fd = _open_lock(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:  # someone else's, not ours to read: we cannot tell, so it is taken to be alive
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held; or no locks on this filesystem, where a writer is taken to be alive
        return True
    finally:
        os.close(fd)
    return False


def remove_dead_writer_locks(root: Path) -> list[Path]:
    """Remove the writer locks under ``root`` whose process is gone; return them."""
    removed: list[Path] = []
    if fcntl is None:
        return removed
    for directory, _, files in os.walk(root):
        if os.path.basename(directory) != WRITERS:
            continue
        for name in files:
            if not re.fullmatch(TOKEN, name):
                continue
            lock = Path(directory) / name
            try:
                fd = _open_lock(lock, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same_file(fd, lock):
                    lock.unlink()  # under the lock: a writer starting on it locks, sees it gone, retries
                    removed.append(lock)
            except OSError:
                pass  # held: a live writer
            finally:
                os.close(fd)
    return sorted(removed)
