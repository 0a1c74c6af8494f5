"""The index of one cache entry, defined once: ``(size, piece, compiler) -> ArtifactRecord``.

Written as a Python literal and read back only with ``ast.literal_eval`` and a type check on
every key and value (never ``eval``, never pickle). This module owns how two indexes merge
(``Index.merged_with``) and how an index in memory takes in the entry's file (``merged_with_file``).
"""

from __future__ import annotations

import ast
import pprint
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tessera.config import Shape, Size, SizeRange
from tessera.validation import is_int

VERSION = 2
FILE = "index.py"  # its name in an entry's directory
HEADER = "# tessera cache index: a Python literal, read with ast.literal_eval.\n"

# How a size is written: "general", an int (one static size), a (start, end) pair (a range), or
# "shape 4x128" (one static value per dynamic size).
SizeKey = str | int | tuple[int, int | None]
_SHAPE = re.compile(r"shape [1-9][0-9]*(x[1-9][0-9]*)+")
IndexKey = tuple[SizeKey, int, str]


def size_key(size: Size) -> SizeKey:
    if size is None:
        return "general"
    if isinstance(size, SizeRange):
        return (size.start, size.end)
    if isinstance(size, Shape):
        return f"shape {size}"
    return size


def index_key(size: Size, piece: int, compiler: str) -> IndexKey:
    return (size_key(size), piece, compiler)


def artifact_label(key: IndexKey) -> str:
    """A file-name-safe name for one entry, e.g. ``piece3_size16_inductor``."""
    size, index, compiler = key
    if isinstance(size, tuple):
        label = f"range{size[0]}-{'max' if size[1] is None else size[1]}"
    elif isinstance(size, int):
        label = f"size{size}"
    elif size.startswith("shape "):
        label = f"shape{size.removeprefix('shape ')}"
    else:
        label = "general"
    return f"piece{index}_{label}_{compiler}"


@dataclass(frozen=True)
class FileRecord:
    """A file of the entry and what its bytes must hash to. ``file == ""``: nothing on disk."""

    file: str
    sha256: str
    size: int

    def to_literal(self) -> dict[str, Any]:
        return {"file": self.file, "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class ArtifactRecord(FileRecord):
    """One compiled artifact; ``content`` is the hash of the piece it was compiled from, so that
    identical pieces (transformer layers) share one file."""

    content: str = ""

    def to_literal(self) -> dict[str, Any]:
        return {**super().to_literal(), "content": self.content}


@dataclass
class Index:
    """The parsed index of one entry (mutable: a process adds what it compiles)."""

    created: float
    entries: dict[IndexKey, ArtifactRecord] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # side file name -> sha256
    model: FileRecord | None = None  # the whole-model artifact

    def merged_with(self, other: Index) -> Index:
        """This index with what ``other`` (read from disk) recorded and this one lacks."""
        return Index(
            created=min(self.created, other.created),
            entries={**other.entries, **self.entries},
            files={**other.files, **self.files},
            model=self.model if self.model is not None else other.model,
        )

    def format(self) -> str:
        data: dict[str, Any] = {
            "version": VERSION,
            "created": self.created,
            "entries": {k: v.to_literal() for k, v in self.entries.items()},
            "files": dict(self.files),
        }
        if self.model is not None:
            data["model"] = self.model.to_literal()
        return HEADER + pprint.pformat(data, width=100, sort_dicts=True) + "\n"


def read(entry: Path) -> Index:
    """The index of the entry at ``entry``; OSError / ValueError / SyntaxError if unreadable."""
    return parse((entry / FILE).read_text(encoding="utf-8"))


def merged_with_file(index: Index, entry: Path) -> Index:
    """``index`` with what the entry's index file holds and ``index`` lacks (what other processes
    recorded); ``index`` as it is when that file is missing or unreadable (a write replaces it)."""
    try:
        return index.merged_with(read(entry))
    except (OSError, ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
        return index


def parse(text: str) -> Index:
    """The index in ``text``, or ValueError/SyntaxError naming what is wrong."""
    data = ast.literal_eval(text)
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} tessera index")
    created = data.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool):
        raise ValueError("'created' is missing")
    entries = data.get("entries")
    if not isinstance(entries, dict):
        raise ValueError("'entries' is not a dict")
    parsed: dict[IndexKey, ArtifactRecord] = {}
    for key, value in entries.items():
        _check_key(key)
        record = _file_record(value, f"entry {key!r}")
        content = value.get("content", "")
        if not isinstance(content, str):
            raise ValueError(f"entry {key!r}: 'content' is not a str")
        parsed[key] = ArtifactRecord(record.file, record.sha256, record.size, content)
    files = data.get("files", {})
    if not (
        isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
    ):
        raise ValueError("'files' is not a dict of name -> sha256")
    for name in files:
        check_relative(name, f"file {name!r}")
    model = data.get("model")
    return Index(
        created=float(created),
        entries=parsed,
        files=dict(files),
        model=None if model is None else _file_record(model, "'model'"),
    )


def _check_key(key: Any) -> None:
    if not (isinstance(key, tuple) and len(key) == 3):
        raise ValueError(f"entry key {key!r} is not (size, piece, compiler)")
    size, index, compiler = key
    size_ok = (
        size == "general"
        or (isinstance(size, str) and _SHAPE.fullmatch(size) is not None)
        or is_int(size)
        or (
            isinstance(size, tuple)
            and len(size) == 2
            and is_int(size[0])
            and (size[1] is None or is_int(size[1]))
        )
    )
    if not (size_ok and is_int(index) and isinstance(compiler, str)):
        raise ValueError(f"entry key {key!r} has wrong types")


def _file_record(value: Any, what: str) -> FileRecord:
    if not (
        isinstance(value, dict)
        and isinstance(value.get("file"), str)
        and isinstance(value.get("sha256"), str)
        and is_int(value.get("size"))
    ):
        raise ValueError(f"{what} lacks file/sha256/size")
    if value["file"]:
        check_relative(value["file"], what)
    return FileRecord(value["file"], value["sha256"], value["size"])


def check_relative(name: str, what: str) -> None:
    """ValueError unless ``name`` is a plain relative path inside an entry."""
    path = PurePosixPath(name)
    if not path.parts or path.is_absolute() or ".." in path.parts or "\\" in name:
        raise ValueError(f"{what} points outside the cache entry")
