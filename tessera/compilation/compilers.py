"""Compiler adaptors: one interface to turn a piece graph into a callable, and back from disk.

Built in: ``eager`` (run the graph as is) and ``inductor`` (Inductor standalone compile, stored
as a piece file that also loads without Inductor, see piece_file.py). A user's own compiler is named
``"package.module:ClassName"`` and implements ``Compiler``.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
import torch.fx

from tessera import _compat, counters
from tessera.config import CompileConfig, Shape, Size
from tessera.errors import CompilerError, ConfigError

if TYPE_CHECKING:
    from tessera.compilation.compile_jobs import JobDone, PieceJob

log = logging.getLogger(__name__)


@runtime_checkable
class Compiler(Protocol):
    """What tessera needs from a compiler. ``name`` keys the cache index.

    ``compile`` returns a handle: a file it wrote (relative to the cache dir), ``""`` when the
    callable rebuilds from the graph alone, or None when it cannot be saved at all.
    """

    name: str

    def compute_hash(self) -> str:
        """A hash of everything about this compiler that changes its output."""
        ...

    def initialize_cache(self, cache_dir: Path | None) -> None:
        """Where artifacts go (None: keep nothing on disk)."""
        ...

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        config: CompileConfig,
        size: Size,
        key: str,
    ) -> tuple[Callable[..., Any], Any]:
        """Compile ``graph``; return the callable and a handle ``load`` can rebuild it from."""
        ...

    def load(
        self,
        handle: Any,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        index: int,
        size: Size,
    ) -> Callable[..., Any]:
        """Rebuild a callable from a handle ``compile`` returned (in this or another process)."""
        ...


# Optional compiler features: a compiler has one when it has the member (isinstance checks).
@runtime_checkable
class HashesCheaply(Protocol):
    """A hash for the model fingerprint that imports no compiler machinery (a warm start)."""

    def warm_hash(self) -> str: ...


@runtime_checkable
class KeepsMachineRecord(Protocol):
    """Keeps the results of per-process probes (CPU ISA, ...) in a file per machine."""

    def use_machine_record(self, root: Path) -> None: ...


@runtime_checkable
class ShowsOutputCode(Protocol):
    """Tells the generated code behind a compiled callable (debug dumps)."""

    def output_code(self, fn: Callable[..., Any]) -> str | None: ...


@runtime_checkable
class CountsPartitions(Protocol):
    """Tells how many partitions a compiled callable has (graph_partition mode)."""

    def partitions_of(self, fn: Callable[..., Any]) -> int | None: ...


@runtime_checkable
class LoadsWithoutGraph(Protocol):
    """Its saved artifacts load without the piece's graph (so a warm start need not rebuild it)."""

    loads_without_graph: bool


@runtime_checkable
class CompilesInWorkers(Protocol):
    """Compiles a piece at a static size or the general one in a worker process (compile_pool.py):
    ``job`` describes the compile (None: this one cannot leave the process), ``finish`` loads what
    the worker saved."""

    def job(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        config: CompileConfig,
        size: int | Shape | None,
        key: str,
    ) -> PieceJob | None: ...

    def finish(self, done: JobDone) -> tuple[Callable[..., Any], Any]: ...


def warm_hash(compiler: Compiler) -> str:
    """A compiler's hash for the model fingerprint: cheap, imports no compiler machinery."""
    if isinstance(compiler, HashesCheaply):
        return compiler.warm_hash()
    return compiler.compute_hash()


def loads_without_graph(compiler: Compiler) -> bool:
    return isinstance(compiler, LoadsWithoutGraph) and compiler.loads_without_graph


class EagerCompiler:
    """Runs each piece's FX graph as Python: no compile work, nothing saved."""

    name = "eager"

    def compute_hash(self) -> str:
        # A version tag, not factors: the eager compiler's output depends on nothing but the graph.
        return hashlib.sha256(b"tessera-eager-v1").hexdigest()

    def initialize_cache(self, cache_dir: Path | None) -> None:
        pass

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        config: CompileConfig,
        size: Size,
        key: str,
    ) -> tuple[Callable[..., Any], Any]:
        counters.bump("eager_compiles")
        # The bound forward skips nn.Module.__call__ (hooks, tracing state): pure dispatch cost.
        return graph.forward, ""

    def load(
        self,
        handle: Any,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        index: int,
        size: Size,
    ) -> Callable[..., Any]:
        return graph.forward


def make_compiler(backend: str) -> Compiler:
    """The compiler a ``CompileConfig.backend`` names; ``CompilerError`` if it cannot be had."""
    if backend == "eager":
        return EagerCompiler()
    if backend == "inductor":
        from tessera.compilation.inductor_compiler import InductorCompiler

        return InductorCompiler()
    module_name, sep, class_name = backend.partition(":")
    if not sep or not module_name or not class_name:
        raise CompilerError(f"backend={backend!r}: expected 'inductor', 'eager' or 'module:Class'")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise CompilerError(
            f"backend={backend!r}: cannot import {class_name} from {module_name} ({e}); check the "
            "module is importable here and defines the class"
        ) from e
    compiler = cls()
    missing = [m for m in ("compute_hash", "initialize_cache", "compile", "load") if not hasattr(compiler, m)]
    if missing or not isinstance(getattr(compiler, "name", None), str):
        raise CompilerError(
            f"backend={backend!r}: {class_name} must define a str 'name' and methods "
            f"compute_hash, initialize_cache, compile, load (missing: {missing or ['name']})"
        )
    return compiler  # type: ignore[no-any-return]


def check_backend(config: CompileConfig) -> None:
    """Refuse now (at ``tessera.compile``) a backend the first call could not use: a custom
    compiler that does not import, or one ``mode='stock'`` cannot run."""
    if config.mode == "stock":
        _check_stock(config.backend)
    elif config.mode != "none" and config.backend not in ("inductor", "eager"):
        make_compiler(config.backend)  # a custom one must import (the built-in ones do)


def _check_stock(name: str) -> None:
    if name not in ("inductor", "eager"):
        raise ConfigError(
            f"mode='stock' runs torch.compile's own backends; backend={name!r} needs "
            "mode='piecewise' or 'trace_once', or use backend='inductor' or 'eager'"
        )


def stock_backend(name: str) -> Callable[..., Any]:
    """torch.compile's own ``name`` backend for mode="stock", counting what it traces and compiles."""
    _check_stock(name)
    inner = _compat.dynamo().lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        counters.bump("graphs_traced")
        counters.bump("inductor_compiles" if name == "inductor" else "eager_compiles")
        return inner(gm, example_inputs)

    return backend


def __getattr__(name: str) -> Any:
    # ``tessera.compilation.compilers.InductorCompiler``, imported when first read: its module (the artifact
    # files, the cache's entry code) is not needed by a first call served eagerly.
    if name == "InductorCompiler":
        from tessera.compilation.inductor_compiler import InductorCompiler

        return InductorCompiler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
