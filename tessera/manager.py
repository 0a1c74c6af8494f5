"""The compiler manager: load an artifact from the cache index, or compile it and record it.

The index maps ``(size, piece index, compiler name)`` to the compiler's handle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx

from tessera import counters
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

    def __init__(self, compiler: Compiler, config: CompileConfig, store: Any | None = None) -> None:
        self.compiler = compiler
        self.config = config
        self.store = store  # the persistent cache entry (tessera.cache.CacheEntry) or None
        self.index: dict[IndexKey, Any] = store.read_index() if store is not None else {}
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
            return CompileOutcome(fn, time.perf_counter() - start, loaded=True)
        if self.store is not None:
            counters.bump("cache_misses")
        fn, handle = self.compiler.compile(graph, example_inputs(), self.config, size, artifact_name(key))
        if self.store is not None and handle is not None:
            self.index[key] = handle
            self.store.record(key, handle)
        seconds = time.perf_counter() - start
        log.debug("compiled piece %d (%s) in %.2fs", index, size_label(size), seconds)
        return CompileOutcome(fn, seconds, loaded=False)

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
                problem = f"{type(e).__name__}: {e}"
        self.store.report_damage(handle, problem)
        del self.index[key]
        return None
