"""``tessera.compile`` and the ``CompiledModel`` it returns: the public entry point.

Chooses the mode's path (none / stock / trace_once / piecewise) and runs the first call: a warm
start from the whole-model artifact when there is one, else the one Dynamo trace.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tessera import counters
from tessera.backend import PiecewiseBackend
from tessera.cache.artifact import WarmStartUnavailable
from tessera.cache.key import fingerprint
from tessera.cache.store import cache_root, rank_dir
from tessera.compilers import make_compiler, warm_hash
from tessera.config import CompileConfig
from tessera.errors import ConfigError
from tessera.piece import PieceRecord
from tessera.wrapper import (
    DynamicDims,
    bind_arguments,
    choose_dynamic_dims,
    mark_dynamic,
    split_callable,
    trace_once,
)

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
        self._call: Callable[..., Any] = self._first_call
        self.marked_dims: list[tuple[str, int]] = []
        self.first_call_seconds: float | None = None
        self.warm_start: bool | None = None  # True: rebuilt from the whole-model artifact
        self.warm_start_refused: str | None = None  # why the whole-model artifact was not used
        self._deferred = 0  # calls run eagerly while waiting for a size a general graph can come from

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    @property
    def name(self) -> str:
        return self.prefix or self._func.__qualname__

    @property
    def pieces(self) -> tuple[PieceRecord, ...]:
        """One frozen record per piece (empty before the first call and in modes without pieces)."""
        return () if self._backend is None else self._backend.pieces()

    @property
    def cache_dir(self) -> Path | None:
        """Where this model's artifacts live; None when the cache is disabled or not yet used."""
        backend = self._backend
        return backend.store.path if backend is not None and backend.store is not None else None

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
        if backend is None:
            log.info("%s: mode %s ready in %.2fs", self.name, self.config.mode, self.first_call_seconds)
            return
        kind = "warm" if backend.compiled == 0 and backend.loaded > 0 else "cold"
        log.info(
            "%s: %s start in %.2fs (%s; %d artifact(s) loaded, %d compiled; cache %s)",
            self.name,
            kind,
            self.first_call_seconds,
            "no Dynamo trace" if self.warm_start else "one Dynamo trace",
            backend.loaded,
            backend.compiled,
            self.cache_dir or "disabled",
        )

    def _compile(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Callable[..., Any] | None]:
        """The first call's output and the callable for later calls (None: compile deferred)."""
        mode = self.config.mode
        if mode == "none":
            return self.model(*args, **kwargs), self.model
        values = bind_arguments(self._func, self._bound_to, args, kwargs)
        choice = choose_dynamic_dims(self._func, values, self._dynamic_dims)
        self.marked_dims = list(choice.dims)
        if mode == "stock":
            mark_dynamic(values, choice)
            compiled = torch.compile(self.model, backend=_counting_backend(self.config.backend))
            return compiled(*args, **kwargs), compiled
        compiler = make_compiler(self.config.backend)
        root = None if self.config.disable_cache else cache_root(self.config.cache_dir)
        prefix = self.prefix or "model"
        print_ = None
        if root is not None:
            print_ = fingerprint(
                self._func,
                self._bound_to,
                values,
                choice.dims,
                self.config,
                warm_hash(compiler),
                prefix,
                rank_dir(),
            )
            try:
                self._backend, call = PiecewiseBackend.from_artifact(
                    self.config, compiler, root, prefix, print_, self._func, self._bound_to
                )
            except WarmStartUnavailable as e:
                self.warm_start_refused = str(e)
                log.info("%s: no start from the whole-model artifact (%s); tracing once", self.name, e)
            else:
                self.warm_start = True
                return call(*args, **kwargs), call
        degenerate = [(n, d) for n, d in choice.dims if values[n].shape[d] < 2]
        if degenerate:
            # Dynamo specializes sizes 0 and 1 even on marked dims, and models branch on them
            # (transformers: `q_length > 1`), so a trace at size 1 is a trace for size 1 only.
            # Run this call eagerly and trace at the first call with a general size instead.
            if not self._deferred:
                log.info(
                    "%s: first call has dynamic size < 2 at %s; runs eagerly, compiles at a size >= 2",
                    self.name,
                    degenerate,
                )
            self._deferred += 1
            return self.model(*args, **kwargs), None
        backend = PiecewiseBackend(self.config, compiler, root, prefix)
        mark_dynamic(values, choice)
        output, call, code = trace_once(self._func, self._bound_to, backend, args, kwargs)
        self._backend = backend
        self.warm_start = False
        if print_ is not None:
            backend.save_artifact(print_, self._func, code)
        return output, call


def _counting_backend(name: str) -> Callable[..., Any]:
    if name not in ("inductor", "eager"):
        raise ConfigError(
            f"mode='stock' runs torch.compile's own backends; backend={name!r} needs "
            "mode='piecewise' or 'trace_once', or use backend='inductor' or 'eager'"
        )
    from tessera import _compat

    inner = _compat.dynamo().lookup_backend(name)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        counters.bump("graphs_traced")
        counters.bump("inductor_compiles" if name == "inductor" else "eager_compiles")
        return inner(gm, example_inputs)

    return backend
