"""The compiler manager: each artifact loaded from the entry's index, or compiled once and recorded.

Pieces are keyed by their own content before compiling, so identical pieces (transformer layers)
are compiled and stored once, whatever state Inductor's own cache is in.
"""

from __future__ import annotations

import enum
import logging
import os
import pickle
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx

from tessera import counters
from tessera.cache import liveness, trust
from tessera.cache.entry import ARTIFACTS, CacheEntry, warn_write_failed
from tessera.cache.index import ArtifactRecord, artifact_label, index_key, size_key
from tessera.cache.key import KeyRecord
from tessera.cache.refusal import Refused
from tessera.compilation.compilers import Compiler
from tessera.config import CompileConfig, Size, size_label
from tessera.errors import ArtifactDamaged, CompilerError
from tessera.report import Fallback

log = logging.getLogger(__name__)

# What a compiler's load raises when the file's bytes are not an artifact (damage: recompile).
# Anything else is a failure of the loader itself, which a recompile would not cure.
DAMAGE_ERRORS = (ArtifactDamaged, pickle.UnpicklingError, EOFError)


class Source(str, enum.Enum):
    """How an artifact was obtained (a str: the report and its JSON show the value)."""

    COMPILED = "compiled"
    LOADED = "loaded"  # from the cache
    SHARED = "shared"  # an identical piece's, in this process

    def __str__(self) -> str:  # in logs and f-strings the word, not "Source.COMPILED" (Python 3.11)
        return self.value


@dataclass(frozen=True)
class CompileOutcome:
    """One artifact obtained: the callable, how long it took, and where it came from."""

    fn: Callable[..., Any]
    seconds: float
    source: Source
    record: ArtifactRecord | None = None
    worker: int | None = None  # the pid of the compile worker that compiled it (compile_pool.py)


@dataclass(frozen=True)
class Obtained:
    """One artifact a model obtained, in the order obtained (the report's table and timeline)."""

    piece: str
    size: Size
    outcome: CompileOutcome
    at: float  # wall-clock seconds when it was in hand


class ArtifactCache:
    """Owns one compiler, the entry it records into, and the artifacts of this process."""

    def __init__(self, compiler: Compiler, config: CompileConfig, entry: CacheEntry | None = None) -> None:
        self.compiler = compiler
        self.config = config
        self.entry = entry
        self._compiler_hash: str | None = None  # computed on first compile: it may import the compiler
        self._by_content: dict[str, CompileOutcome] = {}
        self.loaded = 0
        self.compiled = 0
        self.fallbacks: list[Fallback] = []  # artifacts the index vouched for that could not serve
        compiler.initialize_cache(entry.path if entry is not None else None)

    def content_key(self, piece_content: str, size: Size) -> str:
        """What identifies one artifact of a piece: its content, the size, the compiler and config
        (identical pieces, such as transformer layers, get one artifact)."""
        return self.artifact_key(piece_content, size).digest

    def artifact_key(self, piece_content: str, size: Size) -> KeyRecord:
        if self._compiler_hash is None:
            self._compiler_hash = self.compiler.compute_hash()
        factors = self.config.hash_factors()
        return KeyRecord.of(
            "artifact",
            {
                "piece": piece_content,
                "size": size_key(size),
                "compiler": self.compiler.name,
                "compiler_hash": self._compiler_hash,
                "inductor_config": factors["inductor_config"],
                "passes": factors["passes"],
            },
        )

    def get(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Callable[[], Sequence[Any]],
        size: Size,
        index: int,
        content: str,
    ) -> CompileOutcome:
        """The artifact for ``(size, index)``: from the index, from an identical piece, or compiled.

        ``example_inputs`` is a thunk: specialized inputs are only built when compiling.
        """
        counters.bump("backend_compilations")
        found = self.find(graph, size, index, content)
        if found is not None:
            return found
        return self.compile(graph, example_inputs, size, index, content)

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Callable[[], Sequence[Any]],
        size: Size,
        index: int,
        content: str,
    ) -> CompileOutcome:
        """Compile ``(size, index)`` in this process and record it (``get`` once nothing was found)."""
        start = time.perf_counter()
        scratch = self.scratch_name(size, index)
        fn, handle = self.compiler.compile(graph, example_inputs(), self.config, size, scratch)
        return self.record_compiled(fn, handle, size, index, content, time.perf_counter() - start)

    def scratch_name(self, size: Size, index: int) -> str:
        """Where a compile of ``(size, index)`` writes its file before it is recorded.

        A unique scratch name: several processes may compile the same entry at once. Its writer
        token tells `cache clear` that this process is alive until the artifact is recorded (a
        compile worker's file is this process's too: it records it)."""
        key = index_key(size, index, self.compiler.name)
        owner = None
        if self.entry is not None:
            owner = self._write(lambda entry: liveness.writer_token(entry.path / ARTIFACTS))
        return f"{ARTIFACTS}/.{artifact_label(key)}.{owner or os.getpid()}.{uuid.uuid4().hex[:8]}"

    def record_compiled(
        self,
        fn: Callable[..., Any],
        handle: Any,
        size: Size,
        index: int,
        content: str,
        seconds: float,
        worker: int | None = None,
    ) -> CompileOutcome:
        """A compile of ``(size, index)`` finished (here or in a worker): recorded, and shared with
        identical pieces."""
        key = index_key(size, index, self.compiler.name)
        self.compiled += 1
        record = None
        if self.entry is not None and handle is not None:
            counters.bump("cache_misses")
            # Recorded only now, after the artifact is complete on disk (and written to the index
            # at the end of the turn): a process that dies mid-compile leaves nothing to trust.
            record = self._write(lambda entry: entry.record_artifact(key, str(handle), content))
        outcome = CompileOutcome(fn, seconds, Source.COMPILED, record, worker)
        self._by_content[content] = outcome
        log.debug("compiled piece %d (%s) in %.2fs", index, size_label(size), outcome.seconds)
        return outcome

    def find(
        self, graph: torch.fx.GraphModule, size: Size, index: int, content: str
    ) -> CompileOutcome | None:
        """The artifact for ``(size, index)`` if it needs no compile: loaded from the index, or an
        identical piece's from this process; None when only a compile would give it."""
        start = time.perf_counter()
        key = index_key(size, index, self.compiler.name)
        loaded = self._load(key, graph, size, index)
        if isinstance(loaded, Fallback):
            counters.bump("artifact_fallbacks")
            self.fallbacks.append(loaded)
        elif loaded is not None:
            counters.bump("cache_hits")
            self.loaded += 1
            outcome = CompileOutcome(loaded[0], time.perf_counter() - start, Source.LOADED, loaded[1])
            self._by_content.setdefault(content, outcome)
            return outcome
        twin = self._by_content.get(content)
        if twin is not None:
            counters.bump("cache_hits")
            shared = twin.record
            if self.entry is not None and shared is not None:
                self._write(lambda entry: entry.link_artifacts({key: shared}))
            return CompileOutcome(twin.fn, time.perf_counter() - start, Source.SHARED, twin.record)
        return None

    def lacks(self, keys: Iterable[Any]) -> bool:
        """Whether the entry's index records no artifact for one of ``keys`` (index keys): a
        compile is coming (a recorded file that turns out damaged is compiled then too)."""
        return self.entry is not None and any(k not in self.entry.index.entries for k in keys)

    def flush(self) -> None:
        """Write what this turn recorded to the entry's index: once, however many pieces."""
        if self.entry is not None:
            self._write(lambda entry: entry.flush())

    def _write(self, update: Callable[[CacheEntry], Any]) -> Any:
        """Apply ``update`` to the entry; on failure (disk full, read-only) warn once, stop using
        the cache for this model's remaining pieces, and keep going with what is in memory."""
        assert self.entry is not None, "_write needs an entry"
        try:
            return update(self.entry)
        except OSError as e:
            warn_write_failed(self.entry.path, e)
            self.entry = None
            self.compiler.initialize_cache(None)
            return None

    def load_only(self, graph: torch.fx.GraphModule, size: Size, index: int) -> CompileOutcome | Refused:
        """The artifact for ``(size, index)`` from the cache, or why not; never compiles."""
        start = time.perf_counter()
        loaded = self._load(index_key(size, index, self.compiler.name), graph, size, index)
        if loaded is None:
            return Refused("its artifact is missing")
        if isinstance(loaded, Fallback):
            return Refused(f"its artifact is {loaded.reason}")
        counters.bump("backend_compilations")
        counters.bump("cache_hits")
        self.loaded += 1
        return CompileOutcome(loaded[0], time.perf_counter() - start, Source.LOADED, loaded[1])

    def _load(
        self, key: Any, graph: torch.fx.GraphModule, size: Size, index: int
    ) -> tuple[Callable[..., Any], ArtifactRecord] | Fallback | None:
        """The recorded artifact for ``key``; None if none is recorded; a Fallback (reported once
        and forgotten, so that the caller obtains it again) if the file cannot serve.

        A file that passes its checksum but that the compiler's load fails on for another reason
        than its bytes (``DAMAGE_ERRORS``) is a ``CompilerError``: a loader bug, not damage.
        """
        if self.entry is None:
            return None
        record = self.entry.index.entries.get(key)
        if record is None:
            return None
        subject = f"piece {index} ({size_label(size)}): {record.file or 'nothing on disk'}"
        untrusted = trust.problem(self.entry.path / record.file) if record.file else None
        if untrusted is not None:
            trust.warn_once(self.entry.path / record.file, untrusted, "not loading it; compiling the piece")
            self.entry.forget(key)
            return Fallback("piece artifact", subject, "untrusted", untrusted)
        problem = self.entry.check(record)
        if problem is None:
            try:
                return self.compiler.load(record.file, graph, (), index, size), record
            except DAMAGE_ERRORS as e:  # the bytes are not an artifact: damage, recompiled
                problem = f"not loadable ({type(e).__name__}: {str(e)[:120]})"
            except Exception as e:  # re-raised with the piece and file named, never swallowed
                raise CompilerError(
                    f"compiler {self.compiler.name!r} failed to load {self.entry.path / record.file} "
                    f"for piece {index} ({size_label(size)}): {type(e).__name__}: {e}. The file passed "
                    "its checksum, so this is not cache damage but a failure of the compiler's load() "
                    "(a bug, or what it needs is missing here), and recompiling would not cure it. Fix "
                    "the loader, or compile without the cache (disable_cache=True)"
                ) from e
        self.entry.report_damage(record.file, problem)
        self.entry.forget(key)
        return Fallback("piece artifact", subject, "damage", problem)
