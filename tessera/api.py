"""``tessera.compile`` and the ``CompiledModel`` it returns: the public entry point.

Chooses the mode's path (none / stock / trace_once / piecewise) and runs the first call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tessera import artifact, counters
from tessera.backend import PiecewiseBackend
from tessera.cache import cache_root
from tessera.compilers import make_compiler
from tessera.config import CompileConfig
from tessera.errors import ConfigError
from tessera.piece import PieceRecord
from tessera.split import SplitItem
from tessera.warmstart import record_warm_start, try_warm_start
from tessera.wrapper import DynamicDims, mark_dynamic_dims, split_callable, trace_once

log = logging.getLogger(__name__)


def compile(
    model: Callable[..., Any],
    config: CompileConfig | None = None,
    *,
    dynamic_dims: DynamicDims | None = None,
    prefix: str | None = None,
    **overrides: Any,
) -> CompiledModel:
    """Compile ``model`` (an ``nn.Module`` or a function) for fast repeated inference.

    Nothing is traced until the first call; keyword ``overrides`` replace ``config`` fields.
    """
    config = (config or CompileConfig()).replace(**overrides)
    if prefix is not None and (not prefix or "/" in prefix or prefix.startswith(".")):
        raise ConfigError(f"prefix={prefix!r} must be a plain directory name such as 'backbone'")
    return CompiledModel(model, config, dynamic_dims, prefix)


class CompiledModel:
    """Same call signature and results as the model; ``pieces`` and ``cache_dir`` tell the rest."""

    def __init__(
        self,
        model: Callable[..., Any],
        config: CompileConfig,
        dynamic_dims: DynamicDims | None,
        prefix: str | None,
    ) -> None:
        self.model = model
        self.config = config
        self.prefix = prefix
        self._func, self._bound_to = split_callable(model)
        self._dynamic_dims = dynamic_dims
        self._lock = threading.Lock()
        self._backend: PiecewiseBackend | None = None
        self._items: list[SplitItem] = []
        self._cache_dir: Path | None = None
        self._call: Callable[..., Any] = self._first_call
        self.marked_dims: list[tuple[str, int]] = []
        self.first_call_seconds: float | None = None
        self._traced: bool | None = None
        self._deferred = 0  # calls run eagerly while waiting for a size a general graph can come from

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    @property
    def pieces(self) -> tuple[PieceRecord, ...]:
        """One frozen record per piece (empty before the first call and in modes without pieces)."""
        if self._backend is None:
            return ()
        return self._backend.pieces(self._items)

    @property
    def cache_dir(self) -> Path | None:
        """Where this model's artifacts live; None when the cache is disabled or not yet used."""
        return self._cache_dir

    @property
    def split_graph(self) -> torch.fx.GraphModule | None:
        """The split module (pieces as submodules), after the first call in piecewise modes."""
        return self._backend.split_gm if self._backend is not None else None

    def _first_call(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            if self._call != self._first_call:  # another thread compiled while we waited
                return self._call(*args, **kwargs)
            start = time.perf_counter()
            output, call = self._compile(args, kwargs)
            if call is None:  # deferred: this call ran eagerly
                return output
            self._call = call
            self.first_call_seconds = time.perf_counter() - start
            self._log_start()
            return output

    def _log_start(self) -> None:
        """One line per model: cold or warm, how long, what was loaded and compiled, where."""
        backend = self._backend
        name = self.prefix or self._func.__qualname__
        if backend is None:
            log.info("%s: mode %s ready in %.2fs", name, self.config.mode, self.first_call_seconds)
            return
        manager = backend.manager
        kind = "warm" if manager.compiled == 0 and manager.loaded > 0 else "cold"
        log.info(
            "%s: %s start in %.2fs (%s; %d artifact(s) loaded, %d compiled; cache %s)",
            name,
            kind,
            self.first_call_seconds,
            "no Dynamo trace" if self._traced is False else "one Dynamo trace",
            manager.loaded,
            manager.compiled,
            self._cache_dir or "disabled",
        )

    def _compile(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Callable[..., Any] | None]:
        """The first call's output and the callable for later calls (None: compile deferred)."""
        mode = self.config.mode
        if mode == "none":
            return self.model(*args, **kwargs), self.model
        self.marked_dims, arguments = mark_dynamic_dims(
            self._func, self._bound_to, args, kwargs, self._dynamic_dims
        )
        if mode == "stock":
            compiled = torch.compile(self.model, backend=_counting_backend(self.config.backend))
            return compiled(*args, **kwargs), compiled
        compiler = make_compiler(self.config.backend)
        root = None if self.config.disable_cache else cache_root(self.config.cache_dir)
        prefix = self.prefix or "model"
        backend = PiecewiseBackend(self.config, compiler, root, prefix, on_graph=self._on_graph)
        self._backend = backend
        print_ = None
        if root is not None:
            print_ = artifact.fingerprint(
                self._func,
                self._bound_to,
                arguments,
                self.marked_dims,
                self.config,
                compiler.compute_hash(),
                prefix,
            )
            warm = try_warm_start(backend, root, print_, self._func, self._bound_to)
            if warm is not None:
                call, self._items = warm
                self._traced = False
                self._cache_dir = backend.store.path if backend.store is not None else None
                return call(*args, **kwargs), call
        degenerate = [(n, d) for n, d in self.marked_dims if arguments[n].shape[d] < 2]
        if degenerate:
            # Dynamo specializes sizes 0 and 1 even on marked dims, and models branch on them
            # (transformers: `q_length > 1`), so a trace at size 1 is a trace for size 1 only.
            # Run this call eagerly and trace at the first call with a general size instead.
            if not self._deferred:
                log.info(
                    "%s: first call has dynamic size < 2 at %s; runs eagerly, compiles at a size >= 2",
                    self.prefix or self._func.__qualname__,
                    degenerate,
                )
            self._deferred += 1
            self._backend = None
            return self.model(*args, **kwargs), None
        output, call, code = trace_once(self._func, self._bound_to, backend, args, kwargs)
        if print_ is not None and root is not None and backend.store is not None:
            self._cache_dir = backend.store.path
            record_warm_start(backend, root, print_, self._func, code, self._items)
        return output, call

    def _on_graph(self, split_gm: torch.fx.GraphModule, items: Sequence[SplitItem]) -> None:
        self._items = list(items)


def _counting_backend(name: str) -> Callable[..., Any]:
    if name not in ("inductor", "eager"):
        raise ConfigError(
            f"mode='stock' runs torch.compile's own backends; backend={name!r} needs "
            "mode='piecewise' or 'trace_once', or use backend='inductor' or 'eager'"
        )
    inner = torch._dynamo.lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        counters.bump("graphs_traced")
        counters.bump("inductor_compiles" if name == "inductor" else "eager_compiles")
        return inner(gm, example_inputs)

    return backend
