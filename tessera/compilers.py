"""Compiler adaptors: one interface to turn a piece graph into a callable, and back from disk.

Built in: ``eager`` (run the graph as is) and ``inductor`` (Inductor standalone compile). A user's
own compiler is named ``"package.module:ClassName"`` and implements ``Compiler``.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.fx

from tessera import counters
from tessera.config import CompileConfig, SizeRange
from tessera.errors import CompilerError

log = logging.getLogger(__name__)

# What a piece is compiled for: None is the general (symbolic) size, an int one static size.
Size = int | SizeRange | None


def size_label(size: Size) -> str:
    """``general``, ``size 16`` or ``range [9,32]``: how records and logs name an artifact."""
    if size is None:
        return "general"
    if isinstance(size, SizeRange):
        return f"range {size}"
    return f"size {size}"


@runtime_checkable
class Compiler(Protocol):
    """What tessera needs from a compiler. ``name`` keys the cache index."""

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


class EagerCompiler:
    """Runs each piece's FX graph as Python: no compile work, nothing saved."""

    name = "eager"

    def compute_hash(self) -> str:
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
        return graph.forward, None

    def load(
        self,
        handle: Any,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        index: int,
        size: Size,
    ) -> Callable[..., Any]:
        return graph.forward


class InductorCompiler:
    """Inductor's standalone compile; each artifact is one binary file under the cache dir."""

    name = "inductor"

    def __init__(self) -> None:
        self.cache_dir: Path | None = None
        self._loaded: dict[str, Any] = {}

    def compute_hash(self) -> str:
        from torch._inductor import config as inductor_config

        factors = {
            "torch": torch.__version__,
            "torch_git": getattr(torch.version, "git_version", None),
            "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "python": platform.python_version(),
            "machine": platform.machine(),
            "inductor_config": _stable_config_repr(inductor_config),
        }
        return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()

    def initialize_cache(self, cache_dir: Path | None) -> None:
        self.cache_dir = cache_dir

    def _load_file(self, handle: str) -> Any:
        from torch._inductor import CompiledArtifact

        assert self.cache_dir is not None, "load() needs initialize_cache(dir) first"
        return CompiledArtifact.load(path=str(self.cache_dir / handle), format="binary")

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        config: CompileConfig,
        size: Size,
        key: str,
    ) -> tuple[Callable[..., Any], Any]:
        patches: dict[str, Any] = {}
        if isinstance(size, int):
            # A single size is compiled with static shapes: worth Inductor's autotuning.
            patches["max_autotune"] = True
            dynamic_shapes = "from_example_inputs"
        else:
            dynamic_shapes = "from_graph"
        patches.update(config.inductor_config)
        artifact = _standalone_compile(graph, list(example_inputs), dynamic_shapes, patches)
        counters.bump("inductor_compiles")
        handle = None
        if self.cache_dir is not None:
            handle = key
            artifact.save(path=str(self.cache_dir / handle), format="binary")
            counters.bump("artifacts_saved")
        return artifact, handle

    def load(
        self,
        handle: Any,
        graph: torch.fx.GraphModule,
        example_inputs: Sequence[Any],
        index: int,
        size: Size,
    ) -> Callable[..., Any]:
        assert self.cache_dir is not None, "load() needs initialize_cache(dir) first"
        if not isinstance(handle, str):
            raise CompilerError(f"inductor artifact handle must be a file name, got {handle!r}")
        loaded = self._loaded.get(handle)
        if loaded is None:
            # Files are content-addressed: identical pieces (transformer layers) load once.
            loaded = self._load_file(handle)
            self._loaded[handle] = loaded
            counters.bump("artifacts_loaded")
        if _returns_tuple(graph):
            return loaded  # type: ignore[no-any-return]
        # A loaded artifact always returns a list; the piece graph returned a single value.
        return lambda *args: loaded(*args)[0]


def _returns_tuple(graph: torch.fx.GraphModule) -> bool:
    output = next(iter(reversed(graph.graph.nodes)))
    return isinstance(output.args[0], (tuple, list))


def _standalone_compile(
    graph: torch.fx.GraphModule, inputs: list[Any], dynamic_shapes: str, patches: dict[str, Any]
) -> Any:
    from torch._inductor import standalone_compile

    if "donate_graph_module" not in inspect.signature(standalone_compile).parameters:
        # torch < 2.12 (seen on 2.11) may rewrite the graph it is given; we keep using ours for
        # fallbacks and dumps, so hand it a copy. Remove once 2.12 is the oldest supported torch.
        import copy

        graph = copy.deepcopy(graph)
    return standalone_compile(
        graph,
        inputs,
        dynamic_shapes=dynamic_shapes,  # type: ignore[arg-type]
        options={"config_patches": patches},
    )


def _stable_config_repr(module: Any) -> str:
    """The Inductor config as a string that is equal across processes with equal settings."""
    try:
        saved = module.save_config_portable()
    except Exception:  # older torch: fall back to the plain dict of settings
        saved = module.get_config_copy()
    return repr(sorted((k, repr(v)) for k, v in saved.items() if not k.startswith("_")))


def make_compiler(backend: str) -> Compiler:
    """The compiler a ``CompileConfig.backend`` names."""
    if backend == "eager":
        return EagerCompiler()
    if backend == "inductor":
        return InductorCompiler()
    if backend == "inductor_fx":
        # The FX-graph-cache adaptor (artifacts found through Inductor's own cache with an
        # always-hit shape env) exists for torch < 2.8, which has no standalone compile. tessera
        # needs torch >= 2.11, where 'inductor' does the same job through a public API; the
        # private cache internals it would patch change between 2.11 and 2.13.
        raise CompilerError(
            f"backend='inductor_fx' serves torch < 2.8 (Inductor's FX graph cache); this torch "
            f"({torch.__version__}) has standalone compile: use backend='inductor'"
        )
    module_name, sep, class_name = backend.partition(":")
    if not sep or not module_name or not class_name:
        raise CompilerError(f"backend={backend!r}: expected 'inductor', 'eager' or 'module:Class'")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise CompilerError(f"backend={backend!r}: cannot import {class_name} from {module_name}") from e
    compiler = cls()
    missing = [m for m in ("compute_hash", "initialize_cache", "compile", "load") if not hasattr(compiler, m)]
    if missing or not isinstance(getattr(compiler, "name", None), str):
        raise CompilerError(
            f"backend={backend!r}: {class_name} must define a str 'name' and methods "
            f"compute_hash, initialize_cache, compile, load (missing: {missing or ['name']})"
        )
    return compiler  # type: ignore[no-any-return]
