"""``GraphReceiver``: the one adaptor between Dynamo and tessera.

It is what tessera gives Dynamo as its backend, and Dynamo calls it with each graph it traces.
Two paths use it:
- ``tessera.compile``'s traces (traces.py): one graph per trace, built into a ``SplitModel``
  (``build.from_trace``), shared with an earlier trace whose graph is the same, and served as
  traced while its pieces compile in the background.
- the guarded path (``guarded=True``): ``torch.compile(backend="tessera")`` (dynamo_backend.py)
  and models with graph breaks (guarded.py). Dynamo keeps its guards and may hand over many graphs;
  each is compiled up front, recorded as a ``GraphReport`` (``graphs()``), and one whose result
  must carry gradients goes to torch's own backend instead (the grad policy's one exception).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera import _compat, counters
from tessera.cache.key import graph_signature
from tessera.cache.remote import RemoteTier
from tessera.compilation.compilers import Compiler, make_compiler, stock_backend
from tessera.config import CompileConfig
from tessera.errors import TesseraWarning
from tessera.report import GraphReport
from tessera.serving.build import from_trace
from tessera.serving.split_model import SplitModel

log = logging.getLogger(__name__)

_lock = threading.Lock()
_graphs: list[GraphReport] = []  # every graph the guarded path compiled in this process
_warned: set[str] = set()  # what was said once per process


@dataclasses.dataclass
class GraphReceiver:
    """What Dynamo calls with each traced graph: builds a ``SplitModel`` from it (or shares
    one) and returns what runs the graph (its split module's forward)."""

    config: CompileConfig
    prefix: str
    compiler: Compiler | None = None  # None: one of config.backend per graph (one entry each)
    cache_root: Path | None = None
    remote: RemoteTier | None = None
    serve_traced: bool = False
    # The model's SplitModels by graph (and call state): a trace whose graph is one of them shares
    # its pieces instead of splitting and compiling again (None: never shared).
    shared: dict[str, SplitModel] | None = None
    guarded: bool = False  # Dynamo keeps its guards: compiled up front, each graph recorded
    on_graph: Callable[[GraphReport, SplitModel], None] | None = None
    split_model: SplitModel | None = None  # the last graph's; None until Dynamo has called
    # While set (tessera.compile's guarded path, its first call): the dynamic dims of what a graph
    # that ends at a break returns are marked, so that Dynamo traces the frame resumed after the
    # break with them dynamic, as the first frame, and a call of another size compiles nothing.
    mark_outputs: bool = False
    marked: list[torch.Tensor] = dataclasses.field(default_factory=list)
    _warned_sizes: bool = False

    @classmethod
    def for_guarded_path(
        cls,
        config: CompileConfig,
        prefix: str,
        on_graph: Callable[[GraphReport, SplitModel], None] | None = None,
    ) -> GraphReceiver:
        """The receiver of Dynamo's guarded path, with the cache places ``config`` names."""
        from tessera.cache.fleet import cache_places

        places = cache_places(config)
        return cls(
            config, prefix, cache_root=places.root, remote=places.remote, guarded=True, on_graph=on_graph
        )

    @classmethod
    def for_trace(cls, config: CompileConfig, context: Any, shared: dict[str, SplitModel]) -> GraphReceiver:
        """The receiver of one trace of tessera's own (``context``: the model's TraceContext)."""
        from tessera.compilation.compilers import make_compiler

        return cls(
            config,
            context.prefix,
            # A compiler of its own: a compiler writes into one entry at a time (initialize_cache),
            # and this trace's compile runs while another trace's background compile writes into
            # its own entry (one shared compiler sent one's piece files into the other's entry).
            make_compiler(config.backend),
            context.root,
            context.remote,
            serve_traced=True,
            shared=shared,
        )

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if self.guarded:
            return self._guarded(gm, example_inputs)
        # The inputs' strides too: a compiled piece assumes the layouts it was compiled for.
        strides = [
            tuple(map(str, v.stride())) if isinstance(v, torch.Tensor) else None for v in example_inputs
        ]
        key = f"{graph_signature(gm)}:{strides}:{_compat.call_state()!r}"
        existing = self.shared.get(key) if self.shared is not None else None
        if existing is not None and existing.split_forward is not None:
            counters.bump("graphs_shared")
            self.split_model = existing
            return existing.split_forward
        split_model = self._build(gm, example_inputs, self.config)
        if self.shared is not None:
            self.shared[key] = split_model
        assert split_model.split_forward is not None
        return split_model.split_forward

    def received(self) -> SplitModel:
        """The SplitModel Dynamo's graph built; one without pieces when Dynamo made no graph (a
        function with no tensor work calls no backend)."""
        if self.split_model is not None:
            return self.split_model
        compiler = self.compiler or make_compiler(self.config.backend)
        return SplitModel(self.config, compiler, self.cache_root, self.prefix, remote=self.remote)

    def _build(
        self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: CompileConfig
    ) -> SplitModel:
        self.split_model = from_trace(
            gm,
            example_inputs,
            config,
            self.compiler or make_compiler(config.backend),
            self.cache_root,
            self.prefix,
            remote=self.remote,
            serve_traced=self.serve_traced,
        )
        return self.split_model

    def _guarded(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
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
        config = self._config_for(gm).replace(background_compile=False)
        with torch.no_grad():  # nothing requires grad: the graph is an inference graph
            split_model = self._build(gm, example_inputs, config)
        assert split_model.split_forward is not None
        with _lock:
            record = GraphReport(
                index=len(_graphs),
                reason=reason,
                source=source,
                graph_break=graph_break,
                nodes=len(gm.graph.nodes),
                pieces=len(split_model.pieces),
                cache_entry=str(split_model.entry.path) if split_model.entry is not None else None,
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
            self.on_graph(record, split_model)
        dims = _dynamic_output_dims(gm) if graph_break else []
        if dims:
            return self._marking(split_model.split_forward, dims)
        return split_model.split_forward

    def _marking(self, forward: Callable[..., Any], dims: list[tuple[int, list[int]]]) -> Callable[..., Any]:
        """``forward``, marking its outputs' dynamic ``dims`` while ``mark_outputs`` is set."""
        dynamo = _compat.dynamo()

        def marking(*args: Any) -> Any:
            outputs = forward(*args)
            if self.mark_outputs:
                for i, marks in dims:
                    value = outputs[i]
                    if isinstance(value, torch.Tensor):
                        dynamo.maybe_mark_dynamic(value, marks)
                        self.marked.append(value)
            return outputs

        return marking

    def _config_for(self, gm: torch.fx.GraphModule) -> CompileConfig:
        """Listed sizes and ranges specialise one dynamic size; a graph with several
        (``dynamic=True`` makes every dim dynamic) keeps only the listed shapes (listed_shapes.py)
        and its general artifact."""
        from tessera.compilation.piece import free_symbols

        config = self.config
        if not (config.sizes or config.compile_ranges):
            return config
        symbols = free_symbols(_compat.placeholder_values(gm))
        if len(symbols) <= 1:
            return config
        if not self._warned_sizes:
            self._warned_sizes = True
            warnings.warn(
                f"{self.prefix}: a graph has {len(symbols)} dynamic sizes "
                f"({', '.join(sorted(map(str, symbols)))}); listed sizes and compile_ranges specialise "
                "one, so such graphs do not compile them. List shapes instead (compile_sizes=[(4, 128)]: "
                "batch x length), or mark the one dynamic dim with torch._dynamo.mark_dynamic and "
                "compile with dynamic=None",
                TesseraWarning,
                stacklevel=4,
            )
        return config.replace(compile_sizes=config.shapes, compile_ranges=())


def _dynamic_output_dims(gm: torch.fx.GraphModule) -> list[tuple[int, list[int]]]:
    """Each output of ``gm`` with dims of a symbolic size: (position, dims)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = output.args[0] if isinstance(output.args[0], (tuple, list)) else ()
    dims = []
    for i, node in enumerate(returned):
        value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
        if isinstance(value, torch.Tensor):
            marks = [
                d
                for d, size in enumerate(value.shape)
                if isinstance(size, torch.SymInt) and not _compat.is_constant_symint(size)
            ]
            if marks:
                dims.append((i, marks))
    return dims


def graphs() -> tuple[GraphReport, ...]:
    """Every graph the guarded path compiled in this process, in order."""
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
        stacklevel=3,
    )
