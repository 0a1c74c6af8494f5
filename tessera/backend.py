"""The Dynamo backend of ``piecewise`` and ``trace_once``: split, propagate, build piece runners.

Data flow: FX graph → split module → fake propagation (records per piece) → runners swapped in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor

from tessera import counters
from tessera.cache import CacheEntry, open_entry
from tessera.cachekey import SourceFile, collect_factors, graph_signature, traced_sources
from tessera.compilers import Compiler, Size, size_label
from tessera.config import CompileConfig
from tessera.cudagraph import CUDAGraphBackend, CUDAGraphPiece, cuda_graphs_available, resolve_capture_sizes
from tessera.layout import LayoutKeeper, OutputLayout, output_layout
from tessera.manager import CompilerManager
from tessera.piece import PieceRecord, PieceRunner, dynamic_inputs, find_size_source, specialize_inputs
from tessera.split import SplitItem, default_splitting_ops, split_graph

log = logging.getLogger(__name__)
log_cudagraph = logging.getLogger("tessera.cudagraph")


class PiecewiseBackend:
    """Called by Dynamo once with the traced graph; returns the callable that replaces it."""

    def __init__(
        self,
        config: CompileConfig,
        compiler: Compiler,
        cache_root: Path | None,
        prefix: str,
        on_graph: Callable[[torch.fx.GraphModule, Sequence[SplitItem]], None] | None = None,
    ) -> None:
        self.config = config
        self.compiler = compiler
        self.cache_root = cache_root
        self.prefix = prefix
        self.on_graph = on_graph
        self.manager = CompilerManager(compiler, config, None)
        self.store: CacheEntry | None = None
        self.sources: list[SourceFile] = []
        # CUDA graphs: one backend (memory pool) for every piece and size of this model.
        self.graph_backend = CUDAGraphBackend() if cuda_graphs_available(config.cudagraph_mode) else None
        self.capture_sizes = resolve_capture_sizes(config.cudagraph_capture_sizes, config.max_size)
        self.graph_pieces: list[CUDAGraphPiece] = []
        self.layouts: dict[str, OutputLayout | None] = {}
        self.records: dict[str, PieceRecord] = {}
        self.runners: dict[str, PieceRunner] = {}
        self.split_gm: torch.fx.GraphModule | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        counters.bump("graphs_traced")
        if self.config.mode == "trace_once" or self.config.cudagraph_mode == "full":
            specs: Sequence[Any] = ()  # one piece: the whole graph (captured whole in "full")
        elif self.config.splitting_ops is None:
            specs = default_splitting_ops()
        else:
            specs = self.config.splitting_ops
        split_gm, items = split_graph(gm, specs)
        self.split_gm = split_gm
        counters.bump("pieces", len(items))
        counters.bump("compiled_pieces", sum(not item.is_splitting for item in items))
        log.debug(
            "traced graph of %d nodes split into %d piece(s) (%d compiled)",
            len(gm.graph.nodes),
            len(items),
            sum(not item.is_splitting for item in items),
        )
        if self.on_graph is not None:
            self.on_graph(split_gm, items)
        if self.cache_root is not None:
            self.store = self._open_store(gm, split_gm, items)
            self.manager = CompilerManager(self.compiler, self.config, self.store)

        fake_args = _fake_inputs(gm, example_inputs)
        fake_mode = next(
            (a.fake_mode for a in fake_args if isinstance(a, FakeTensor)), None
        ) or detect_fake_mode(example_inputs)
        for item in items:
            if item.is_splitting:
                self.keep_layout(split_gm, item.name, output_layout(item.graph))
        start = time.perf_counter()
        calls = _piece_calls_from_meta(split_gm, items, list(example_inputs))
        if calls is not None:
            for item, piece_fake, piece_real in calls:
                self._install(split_gm, item, piece_fake, piece_real)
        else:  # some input lacks Dynamo's example value: run the split module on fake tensors
            propagator = _Propagator(split_gm, self, items, list(example_inputs))
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                propagator.run(*fake_args)
        log.debug("built %d piece runner(s) in %.2fs", len(self.runners), time.perf_counter() - start)
        # forward, not __call__: skips nn.Module call machinery on every step.
        return split_gm.forward

    def _open_store(
        self, gm: torch.fx.GraphModule, split_gm: torch.fx.GraphModule, items: Sequence[SplitItem]
    ) -> CacheEntry:
        assert self.cache_root is not None, "_open_store needs a cache root"
        sources = traced_sources(_traced_code(gm))
        self.sources = sources
        factors = collect_factors(
            self.config, self.compiler.name, self.compiler.compute_hash(), sources, graph_signature(gm)
        )
        return open_entry(self.cache_root, self.prefix, factors, dump_split_graph(split_gm, items), sources)

    def _install(
        self,
        split_gm: torch.fx.GraphModule,
        item: SplitItem,
        fake_args: Sequence[Any],
        real_args: Sequence[Any | None],
    ) -> None:
        """Build the piece's runner and make the split module call it instead of the submodule."""
        runner = self.build(item, fake_args, real_args)
        self.install(split_gm, self.records[item.name], runner)

    def keep_layout(self, split_gm: torch.fx.GraphModule, name: str, layout: OutputLayout | None) -> None:
        """Route a splitting piece through a LayoutKeeper (see layout.py); remember the layout."""
        self.layouts[name] = layout
        # The eager compiler runs pieces as Python: any layout is fine, so no copies, no checks.
        if layout is not None and self.compiler.name != "eager":
            split_gm.__dict__[name] = LayoutKeeper(getattr(split_gm, name), layout)

    def install(self, split_gm: torch.fx.GraphModule, record: PieceRecord, runner: PieceRunner) -> None:
        """Make the split module call ``runner`` (under CUDA graphs when enabled) for this piece.

        The split module's code calls self.submod_N(...): an instance attribute shadows the
        submodule, so calls go straight to the runner while the GraphModule stays printable.
        """
        self.runners[record.name] = runner
        call: Callable[..., Any] = runner
        if self.graph_backend is not None and record.size_source is not None and record.dynamic is not None:
            call = CUDAGraphPiece(
                record.name,
                runner,
                record.size_source,
                record.dynamic,
                self.capture_sizes,
                self.graph_backend,
                first=not self.graph_pieces,
                debug=log_cudagraph.isEnabledFor(logging.DEBUG),
            )
            self.graph_pieces.append(call)
            self.records[record.name] = dataclasses.replace(record, cudagraph_sizes=self.capture_sizes)
        split_gm.__dict__[record.name] = call

    def build(
        self,
        item: SplitItem,
        fake_args: Sequence[Any],
        real_args: Sequence[Any | None],
    ) -> PieceRunner:
        """Compile (or load) every artifact of one non-splitting piece and make its runner."""
        config = self.config
        output = next(iter(reversed(item.graph.graph.nodes)))
        returns_tuple = isinstance(output.args[0], (tuple, list))
        source = find_size_source(fake_args)
        sizes = config.compile_sizes if source is not None else ()
        ranges = config.ranges if source is not None else ()
        artifacts: dict[Size, Callable[..., Any]] = {}
        seconds = []
        general = self.manager.get(item.graph, lambda: fake_args, None, item.index)
        artifacts[None] = general.fn
        seconds.append((size_label(None), general.seconds))
        for size in sizes:
            outcome = self.manager.get(
                item.graph,
                functools.partial(specialize_inputs, item.name, fake_args, real_args, size),
                size,
                item.index,
            )
            artifacts[size] = outcome.fn
            seconds.append((size_label(size), outcome.seconds))
        for size_range in ranges:
            outcome = self.manager.get(item.graph, lambda: fake_args, size_range, item.index)
            artifacts[size_range] = outcome.fn
            seconds.append((size_label(size_range), outcome.seconds))

        runner = PieceRunner(item.name, artifacts, source, config.max_size)
        returned = output.args[0] if returns_tuple else [output.args[0]]
        outputs = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in returned]
        self.records[item.name] = PieceRecord(
            name=item.name,
            index=item.index,
            is_splitting=False,
            sym_positions=tuple(i for i, a in enumerate(fake_args) if isinstance(a, torch.SymInt)),
            returns_tuple=returns_tuple,
            size_source=source,
            sizes=tuple(sizes),
            ranges=tuple(ranges),
            compile_seconds=tuple(seconds),
            dynamic=dynamic_inputs(fake_args, outputs),
        )
        return runner

    def pieces(self, items: Sequence[SplitItem]) -> tuple[PieceRecord, ...]:
        out = []
        for item in items:
            record = self.records.get(item.name)
            if record is None:
                record = PieceRecord(item.name, item.index, item.is_splitting)
            elif item.name in self.runners:
                record = _with_served(record, self.runners[item.name])
            out.append(record)
        return tuple(out)


def dump_split_graph(split_gm: torch.fx.GraphModule, items: Sequence[SplitItem]) -> str:
    """A readable Python file: the split module, then every piece's code."""
    parts = ["# tessera computation graph: the split module, then each piece.\n", split_gm.code]
    for item in items:
        kind = "splitting (runs as is)" if item.is_splitting else "compiled"
        parts.append(f"\n# ---- {item.name} (piece {item.index}, {kind}) ----\n{item.graph.code}")
    return "".join(parts)


def _with_served(record: PieceRecord, runner: PieceRunner) -> PieceRecord:
    return dataclasses.replace(record, served=runner.served())


class _Propagator(torch.fx.Interpreter):
    """Runs the split module on fake tensors; each non-splitting piece is compiled on the way."""

    def __init__(
        self,
        split_gm: torch.fx.GraphModule,
        backend: PiecewiseBackend,
        items: Sequence[SplitItem],
        real_inputs: list[Any],
    ) -> None:
        super().__init__(split_gm)
        self.backend = backend
        self.items = {item.name: item for item in items}
        placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
        self.real_of = {node: real for node, real in zip(placeholders, real_inputs, strict=True)}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        item = self.items.get(n.target) if n.op == "call_module" else None  # type: ignore[arg-type]
        if item is not None and not item.is_splitting:
            fake_args = [self.env[a] if isinstance(a, torch.fx.Node) else a for a in n.args]
            real_args = [self.real_of.get(a) if isinstance(a, torch.fx.Node) else None for a in n.args]
            self.backend._install(self.module, item, fake_args, real_args)  # type: ignore[arg-type]
        return result


def _traced_code(gm: torch.fx.GraphModule) -> list[Any]:
    """The code objects Dynamo traced for this graph (for the cache key's source files).

    TracingContext.get_traced_code() is the API (torch 2.13); its list attribute is read where
    the method is missing. Failing both, the files named in the graph's stack traces are used.
    """
    context = torch._guards.TracingContext
    getter = getattr(context, "get_traced_code", None)
    if getter is not None:
        return list(getter() or ())
    current = context.try_get()
    codes = getattr(current, "traced_code", None) if current is not None else None
    if codes:
        return list(codes)
    log.warning("this torch does not list traced code; the cache key covers files named in the graph")
    files = {n.meta.get("stack_trace", "") for n in gm.graph.nodes}
    names = {line.split('"')[1] for trace in files for line in trace.splitlines() if 'File "' in line}
    return [compile("", name, "exec") for name in sorted(names)]


def _piece_calls_from_meta(
    split_gm: torch.fx.GraphModule, items: Sequence[SplitItem], real_inputs: list[Any]
) -> list[tuple[SplitItem, list[Any], list[Any | None]]] | None:
    """Per compiled piece: its inputs' fake values (from Dynamo's meta) and real values where known.

    No fake execution: split_module copies each input's example value onto the piece's
    placeholders, which is all a runner needs. None when some example value is missing.
    """
    by_name = {item.name: item for item in items}
    placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    real_of = dict(zip(placeholders, real_inputs, strict=True))
    calls = []
    for node in split_gm.graph.nodes:
        item = by_name.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
        if item is None or item.is_splitting:
            continue
        inputs = [n for n in item.graph.graph.nodes if n.op == "placeholder"]
        fake = [n.meta.get("example_value") for n in inputs]
        if len(fake) != len(node.args) or any(v is None for v in fake):
            return None
        real = [real_of.get(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
        calls.append((item, fake, real))
    return calls


def _fake_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("example_value") for n in placeholders]
    if all(v is not None for v in values):
        return values
    fake_mode = detect_fake_mode(example_inputs)
    assert fake_mode is not None, "no fake mode found for the traced graph's inputs"
    return [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
