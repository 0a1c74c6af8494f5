"""tessera as a Dynamo backend: ``torch.compile(model, backend="tessera", dynamic=True)``.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so a process finds
it by name without importing tessera. Here Dynamo keeps its guards and its own re-compiles; each
graph it hands over goes through tessera's split, per-size compile and content-addressed cache
(``PiecewiseBackend``), so a second process loads every piece and runs no Inductor compile.
``tessera.compile`` uses the same path for models with graph breaks (api.py).

What this path does not give: the guard-free call check and the Dynamo-free warm start of
``tessera.compile`` (Dynamo traces again in every process; only the compiles are saved).
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tessera import _compat, validation
from tessera.config import CompileConfig
from tessera.errors import ConfigError, TesseraWarning
from tessera.report import GraphReport

log = logging.getLogger(__name__)

# torch.compile(mode=...) as CompileConfig fields (fields given in options win).
TORCH_MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {"cudagraph_mode": "piecewise"},
    "max-autotune-no-cudagraphs": {"inductor_config": {"max_autotune": True}},
    "max-autotune": {"inductor_config": {"max_autotune": True}, "cudagraph_mode": "piecewise"},
}
# Options that are not CompileConfig fields: the cache entry's directory name.
EXTRA_OPTIONS = ("prefix",)

_lock = threading.Lock()
_graphs: list[GraphReport] = []
_warned: set[str] = set()  # what was said once per process


def backend_config(options: Mapping[str, Any] | None = None, mode: str | None = None) -> CompileConfig:
    """The CompileConfig that ``torch.compile(..., options=options, mode=mode)`` asks for, checked
    as ``tessera.compile`` checks its keywords (a bad field or value is a ``ConfigError``)."""
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"options={options!r} must be a dict of CompileConfig fields")
    fields = {k: v for k, v in dict(options or {}).items() if k not in EXTRA_OPTIONS}
    if mode is not None and mode not in TORCH_MODES:
        raise ConfigError(
            f"torch.compile mode={mode!r} is not one tessera serves; use one of {list(TORCH_MODES)}"
        )
    for name, value in TORCH_MODES.get(mode or "default", {}).items():
        fields.setdefault(name, value)
    if "fullgraph" in fields:
        raise ConfigError("options fullgraph: under torch.compile, pass torch.compile(..., fullgraph=True)")
    if fields.get("mode", "piecewise") not in ("piecewise", "trace_once"):
        raise ConfigError(
            f"options mode={fields['mode']!r}: under torch.compile tessera compiles Dynamo's graphs, "
            "so the mode is 'piecewise' (split at attention) or 'trace_once' (one piece per graph)"
        )
    prefix = (options or {}).get("prefix", "dynamo")
    validation.check_prefix(prefix, "options prefix", "unet")
    config = CompileConfig().replace(**fields)
    if config.backend == "inductor":
        validation.check_inductor_keys(config.inductor_config)
    return config


def tessera_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The function the ``tessera`` entry point names: Dynamo calls it once per graph."""
    config = backend_config(options, mode)
    prefix = str((options or {}).get("prefix", "dynamo"))
    return GraphCompiler(config, prefix)(gm, example_inputs)


class GraphCompiler:
    """Compiles each graph Dynamo hands over with tessera, and records it (``graphs``).

    ``on_graph`` is told of each graph (api.py keeps a model's graphs for its report)."""

    def __init__(
        self,
        config: CompileConfig,
        prefix: str,
        on_graph: Callable[[GraphReport, Any], None] | None = None,
    ) -> None:
        self.config = config
        self.prefix = prefix
        self.on_graph = on_graph
        self._warned_sizes = False

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from tessera.build import from_trace
        from tessera.cache.fleet import cache_places
        from tessera.compilers import make_compiler, stock_backend

        reason, source, graph_break = _compat.graph_compile_reason(gm)
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
        ):
            # tessera compiles inference graphs; this graph's result must carry gradients.
            # torch's own backend of the same name compiles it (for training), uncached by tessera.
            _warn_grad_once(self.config.backend)
            stock = stock_backend(self.config.backend if self.config.backend == "eager" else "inductor")
            compiled: Callable[..., Any] = stock(gm, example_inputs)
            return compiled
        # Dynamo's guarded path compiles as Dynamo asks, up front: a background thread would
        # compile while Dynamo traces other frames of this process.
        config = self._config_for(gm, example_inputs).replace(background_compile=False)
        places = cache_places(config)
        with torch.no_grad():  # nothing requires grad: the graph is an inference graph
            backend = from_trace(
                gm,
                example_inputs,
                config,
                make_compiler(config.backend),
                places.root,
                self.prefix,
                remote=places.remote,
            )
        assert backend.split_forward is not None
        compiled = backend.split_forward
        with _lock:
            record = GraphReport(
                index=len(_graphs),
                reason=reason,
                source=source,
                graph_break=graph_break,
                nodes=len(gm.graph.nodes),
                pieces=len(backend.pieces),
                cache_entry=str(backend.entry.path) if backend.entry is not None else None,
            )
            _graphs.append(record)
        log.info(
            "%s: graph %d (%d pieces) compiled by tessera; %s",
            self.prefix,
            record.index,
            record.pieces,
            f"graph break at {source}: {reason}" if graph_break else "no graph break after it",
        )
        if self.on_graph is not None:
            self.on_graph(record, backend)
        return compiled

    def _config_for(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> CompileConfig:
        """compile_sizes and ranges specialise one dynamic size; a graph with several
        (``dynamic=True`` makes every dim dynamic) is served by its general artifact alone."""
        from tessera.piece import free_symbols

        config = self.config
        if not (config.compile_sizes or config.compile_ranges):
            return config
        symbols = free_symbols(_compat.placeholder_values(gm))
        if len(symbols) <= 1:
            return config
        if not self._warned_sizes:
            self._warned_sizes = True
            warnings.warn(
                f"{self.prefix}: a graph has {len(symbols)} dynamic sizes "
                f"({', '.join(sorted(map(str, symbols)))}); compile_sizes and compile_ranges specialise "
                "one, so such graphs get the general artifact only. Mark the one dynamic dim with "
                "torch._dynamo.mark_dynamic and compile with dynamic=None to keep them",
                TesseraWarning,
                stacklevel=3,
            )
        return config.replace(compile_sizes=(), compile_ranges=())


def graphs() -> tuple[GraphReport, ...]:
    """Every graph the tessera backend compiled in this process, in order."""
    with _lock:
        return tuple(_graphs)


def _warn_grad_once(backend: str) -> None:
    if "grad" in _warned:
        return
    _warned.add("grad")
    warnings.warn(
        "torch.compile(backend='tessera') got a graph whose result needs gradients; tessera compiles "
        f"inference graphs, so torch's own {backend!r} backend compiles it (not cached by tessera). "
        "Call the model under torch.inference_mode() or torch.no_grad(), or freeze its parameters",
        TesseraWarning,
        stacklevel=2,
    )
