"""The compiler manager: load an artifact from the cache index, or compile it and record it.

The index maps ``(size, piece index, compiler name)`` to the compiler's handle.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx

from tessera import counters
from tessera.cache import CacheEntry
from tessera.compilers import Compiler, Size, size_label
from tessera.config import CompileConfig, SizeRange

log = logging.getLogger(__name__)

# How a size is written in the index: "general", an int, or a (start, end) pair.
SizeKey = str | int | tuple[int, int | None]
IndexKey = tuple[SizeKey, int, str]


def size_key(size: Size) -> SizeKey:
    if size is None:
        return "general"
    if isinstance(size, SizeRange):
        return (size.start, size.end)
    return size


def artifact_name(key: IndexKey) -> str:
    """A file-name-safe name for one index entry, e.g. ``piece3_size16_inductor``."""
    size, index, compiler = key
    if isinstance(size, tuple):
        label = f"range{size[0]}-{'max' if size[1] is None else size[1]}"
    elif isinstance(size, int):
        label = f"size{size}"
    else:
        label = "general"
    return f"piece{index}_{label}_{compiler}"


@dataclass(frozen=True)
class CompileOutcome:
    """One artifact obtained: the callable, how long it took, and whether it came from disk."""

    fn: Callable[..., Any]
    seconds: float
    loaded: bool


class CompilerManager:
    """Owns one compiler and the index of what it has produced for one model."""

    def __init__(self, compiler: Compiler, config: CompileConfig, store: CacheEntry | None = None) -> None:
        self.compiler = compiler
        self.config = config
        self.store = store
        self.index: dict[IndexKey, Any] = store.read_index() if store is not None else {}
        self.loaded = 0
        self.compiled = 0
        compiler.initialize_cache(store.path if store is not None else None)

    def get(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Callable[[], Sequence[Any]],
        size: Size,
        index: int,
    ) -> CompileOutcome:
        """Load the artifact for ``(size, index)`` if the index has it, else compile it.

        ``example_inputs`` is a thunk: specialized inputs are only built when compiling.
        """
        key: IndexKey = (size_key(size), index, self.compiler.name)
        start = time.perf_counter()
        counters.bump("backend_compilations")
        fn = self._try_load(key, graph, size, index)
        if fn is not None:
            counters.bump("cache_hits")
            self.loaded += 1
            return CompileOutcome(fn, time.perf_counter() - start, loaded=True)
        # A unique scratch name: several processes may compile the same entry at once.
        scratch = f"artifacts/.{artifact_name(key)}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        fn, handle = self.compiler.compile(graph, example_inputs(), self.config, size, scratch)
        self.compiled += 1
        if self.store is not None and handle is not None:
            counters.bump("cache_misses")
            # Recorded only now, after the artifact is complete on disk: a process that dies
            # mid-compile leaves no index entry for a later process to trust.
            self.index[key] = self.store.adopt(key, handle)
        seconds = time.perf_counter() - start
        log.debug("compiled piece %d (%s) in %.2fs", index, size_label(size), seconds)
        return CompileOutcome(fn, seconds, loaded=False)

    def load_only(self, graph: torch.fx.GraphModule, size: Size, index: int) -> CompileOutcome | None:
        """The artifact for ``(size, index)`` from the cache, or None; never compiles."""
        key: IndexKey = (size_key(size), index, self.compiler.name)
        start = time.perf_counter()
        fn = self._try_load(key, graph, size, index)
        if fn is None:
            return None
        counters.bump("backend_compilations")
        counters.bump("cache_hits")
        self.loaded += 1
        return CompileOutcome(fn, time.perf_counter() - start, loaded=True)

    def _try_load(
        self, key: IndexKey, graph: torch.fx.GraphModule, size: Size, index: int
    ) -> Callable[..., Any] | None:
        if self.store is None or key not in self.index:
            return None
        handle = self.index[key]
        problem = self.store.check_artifact(handle)
        if problem is None:
            try:
                return self.compiler.load(handle, graph, (), index, size)
            except Exception as e:  # a damaged artifact must cost a recompile, never the process
                problem = f"not loadable ({type(e).__name__}: {str(e)[:120]})"
        self.store.report_damage(handle, problem)
        del self.index[key]
        self.store.forget(key)
        return None
