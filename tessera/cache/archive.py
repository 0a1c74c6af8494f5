"""Bake a cache into an image: ``tessera cache export FILE.tar`` and ``import FILE.tar``.

An archive holds entries (optionally only some prefixes or keys) and the warm pointers that lead
to them. Importing checks every member before anything lands: regular files and directories
only, no path outside the root, every entry's index parsed and every file's checksum verified.
"""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from tessera.cache import liveness, trust
from tessera.cache.entry import atomic_write
from tessera.cache.liveness import INUSE, WRITERS
from tessera.cache.pointer import read_entries, write_pointer
from tessera.cache.root import WARM_DIR
from tessera.cache.tools import find_entries, verify
from tessera.errors import CacheError

_SKIP = (INUSE, ".lock")


def export(root: Path, archive: Path, prefixes: Sequence[str] = (), keys: Sequence[str] = ()) -> int:
    """Write the chosen entries (all by default) and their pointers to ``archive``; how many."""
    entries = [
        e
        for e in find_entries(root)
        if (not prefixes or e.name in prefixes)
        # Key folders hold the first 10 hex digits: a full key or any prefix of one selects them.
        and (not keys or any(e.parents[1].name.startswith(k[:10]) for k in keys))
    ]
    chosen = {e.relative_to(root).as_posix() for e in entries}
    with tarfile.open(archive, "w") as tar:
        for entry in entries:
            for path in sorted(entry.rglob("*")):
                skipped = path.name.endswith(".tmp") or path.name in _SKIP or WRITERS in path.parts
                if path.is_file() and not skipped:
                    tar.add(path, arcname=path.relative_to(root).as_posix(), recursive=False)
        for pointer in sorted((root / WARM_DIR).glob("*.json")):
            try:
                data = json.loads(pointer.read_text(encoding="utf-8"))
                listed = [e for e in data.get("entries", [data]) if e["entry"] in chosen]
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            if listed:  # the traces of this model that the archive holds
                body = json.dumps({"entries": listed}, indent=1).encode()
                info = tarfile.TarInfo(pointer.relative_to(root).as_posix())
                info.size, info.mtime, info.mode = len(body), int(pointer.stat().st_mtime), 0o644
                tar.addfile(info, io.BytesIO(body))
    return len(entries)


def import_(root: Path, archive: Path) -> int:
    """Bring an archive's entries into ``root``; CacheError (nothing imported) if any member is
    unsafe or any entry does not verify. Entries already present are kept as they are."""
    with tarfile.open(archive, "r") as tar:
        members = tar.getmembers()
        for member in members:
            _check_member(member)
        trust.make_dir(root)
        liveness.register_root(root)
        # Named with our writer token: `cache clear` removes it if this process is killed.
        staging_prefix = f".import-{liveness.writer_token(root)}."
        with tempfile.TemporaryDirectory(dir=root, prefix=staging_prefix) as scratch:
            staging = Path(scratch)
            for member in members:
                if member.isdir():
                    continue
                source = tar.extractfile(member)
                assert source is not None, f"{member.name} is a regular file"
                target = staging / member.name
                trust.make_dir(target.parent)
                with io.BytesIO(source.read()) as data:
                    atomic_write(target, data.getvalue())
            problems = verify(staging)
            if problems:
                raise CacheError(f"{archive}: {len(problems)} problem(s), nothing imported: {problems[0]}")
            imported = 0
            for entry in find_entries(staging):
                if _move_in(entry, root / entry.relative_to(staging)):
                    imported += 1
            for pointer in sorted((staging / WARM_DIR).glob("*.json")):
                # Each trace added to the model's pointer here (one this root has is kept).
                listed = read_entries(staging, pointer.stem)
                if not isinstance(listed, tuple):  # a model's path (graph breaks): copied as it is
                    destination = root / WARM_DIR / pointer.name
                    if not destination.exists():
                        atomic_write(destination, pointer.read_bytes())
                    continue
                for trace in listed:
                    path = root / trace.entry.relative_to(staging)
                    write_pointer(root, pointer.stem, path, trace.reason, trace.model_sha)
    return imported


def _move_in(entry: Path, destination: Path) -> bool:
    """Move a verified entry to its place in one rename; False if an entry is there already.

    It arrives with its in-use marker, like an entry a process made: ``cache prune`` ranks it by
    the time it was imported and locks that marker before it removes it.
    """
    (entry / INUSE).touch(mode=trust.file_mode())
    for _ in range(10):
        if destination.exists():
            return False
        trust.make_dir(destination.parent)
        try:
            # A rename, not a copy: a process opening the entry sees all of it or nothing, and
            # one that made the same entry meanwhile keeps it (a non-empty directory stays).
            os.rename(entry, destination)
            return True
        except FileNotFoundError:
            continue  # a pruner removed the empty parent we just made: again
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return False
            raise
    return False


def _check_member(member: tarfile.TarInfo) -> None:
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts or "\\" in member.name:
        raise CacheError(f"archive member {member.name!r} points outside the cache root; refused")
    if not (member.isfile() or member.isdir()):
        raise CacheError(f"archive member {member.name!r} is not a regular file; refused")
