"""A model's pieces built from Dynamo's traced graph (``from_trace``, called by
``receiver.GraphReceiver``, what Dynamo is given): the split at the splitting ops, the cache entry,
every piece compiled or loaded now or left for the background compile (schedule.py), and the
runners swapped into the split module.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera import _compat, counters
from tessera.cache.entry import CacheEntry
from tessera.cache.index import index_key
from tessera.cache.key import (
    SourceFile,
    collect_factors,
    graph_code_objects,
    graph_signature,
    piece_content,
    traced_sources,
)
from tessera.cache.remote import RemoteTier
from tessera.cache.sharing import compile_turn, prefetch
from tessera.compilation.aliases import replay_input_aliases
from tessera.compilation.compile_pool import CompilePool
from tessera.compilation.compile_state import COMPILE_LOCK, CompileState
from tessera.compilation.compilers import Compiler
from tessera.compilation.fan_out import workers_for
from tessera.compilation.layout import output_layout
from tessera.compilation.piece import (
    PieceRecord,
    PieceRunner,
    dynamic_inputs,
    find_size_source,
    shape_sources,
    size_symbols,
)
from tessera.compilation.piece_inputs import saved_inputs
from tessera.compilation.split import (
    SplitItem,
    SplitMatcher,
    default_splitting_ops,
    dump_split_graph,
    piece_calls,
    split_graph,
)
from tessera.compilation.work import Job, PieceWork
from tessera.config import CompileConfig, Shape, Size, size_label
from tessera.debug.progress import CompileProgress, Timing
from tessera.errors import TesseraWarning
from tessera.serving.listed_shapes import describe, input_text, piece_statics, read_shapes
from tessera.serving.split_model import SplitModel, partitions_of

log = logging.getLogger(__name__)


# What draws from a random generator in a Dynamo graph: torch's functions, and tensor methods.
_RANDOM_FUNCTIONS = frozenset(
    {
        "rand",
        "randn",
        "randint",
        "rand_like",
        "randn_like",
        "randint_like",
        "randperm",
        "bernoulli",
        "multinomial",
        "normal",
        "poisson",
        "gumbel_softmax",
    }
)
_RANDOM_METHODS = frozenset(
    {
        "uniform_",
        "normal_",
        "bernoulli",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "random_",
        "multinomial",
    }
)
# Random only in training (their ``training`` argument, the third, True by default).
_DROPOUTS = frozenset(
    {"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d", "rrelu"}
)
_said_random: set[str] = set()


def random_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The calls of ``gm`` (a Dynamo graph) that draw random numbers, by name, once each."""
    found: list[str] = []
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", str(node.target))
        if node.op == "call_function" and name in _DROPOUTS:
            training = node.kwargs.get("training", node.kwargs.get("train", True))
            if len(node.args) > 2:
                training = node.args[2]
            random = training is not False
        elif node.op == "call_function":
            random = name in _RANDOM_FUNCTIONS
        else:
            random = node.op == "call_method" and name in _RANDOM_METHODS
        if random and name not in found:
            found.append(name)
    return found


def _say_random_once(gm: torch.fx.GraphModule, prefix: str) -> None:
    """Tell once per model that its random draws, compiled, are not eager's stream."""
    calls = random_calls(gm)
    if not calls or prefix in _said_random:
        return
    _said_random.add(prefix)
    warnings.warn(
        f"{prefix} draws random numbers ({', '.join(calls)}): compiled by Inductor they come from "
        "Inductor's own generator, so they differ from eager's for the same seed (as under "
        "torch.compile) and the global generator ends in another state. For eager's stream, pass "
        "inductor_config={'fallback_random': True}",
        TesseraWarning,
        stacklevel=3,
    )


def from_trace(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: CompileConfig,
    compiler: Compiler,
    cache_root: Path | None,
    prefix: str,
    *,
    remote: RemoteTier | None = None,
    serve_traced: bool = False,
) -> SplitModel:
    """A complete split_model from Dynamo's traced graph: split at the splitting ops, its cache
    entry made, every piece compiled or loaded (or, in the background, left for
    ``Background.start``) and swapped into the split module (``split_forward``)."""
    counters.bump("graphs_traced")
    if config.mode == "trace_once" or config.cudagraph_mode == "full" or config.graph_partition:
        # One piece, the whole graph: captured whole ("full"), or partitioned by Inductor itself.
        specs: Sequence[Any] = ()
    elif config.splitting_ops is None:
        specs = default_splitting_ops()
    else:
        specs = config.splitting_ops
    start = time.perf_counter()
    matcher = SplitMatcher(specs)
    split_gm, items = split_graph(gm, matcher)
    replay_input_aliases(gm, split_gm)
    # The split module's and the pieces' forward compile here, in the background build, not in
    # the first call served as traced (lazy graph modules: 52 of that call's 62 ms, toy Llama).
    for graph in (split_gm, *(item.graph for item in items)):
        _compat.compile_graph_now(graph)
    if config.splitting_ops:
        for name in matcher.unmatched():
            warnings.warn(
                f"splitting op {name!r} matches no call in the traced graph of {prefix}; "
                "check the name (see computation_graph.py in the cache entry for what was traced)",
                TesseraWarning,
                stacklevel=2,
            )
    if compiler.name == "inductor" and not config.inductor_config.get("fallback_random"):
        _say_random_once(gm, prefix)
    split_dump = dump_split_graph(split_gm, items)
    sources: list[SourceFile] = []
    entry = None
    factors: dict[str, Any] | None = None
    if cache_root is not None:
        sources = traced_sources(graph_code_objects(gm))
        factors = collect_factors(
            config, compiler.name, compiler.compute_hash(), sources, graph_signature(gm)
        )
        entry = CacheEntry.create(cache_root, prefix, factors, split_dump, sources)
    split_model = SplitModel(
        config,
        compiler,
        cache_root,
        prefix,
        entry=entry,
        remote=remote,
        serve_traced=serve_traced,
        sources=sources,
        state=CompileState.current(),  # Dynamo calls us in the traced call's thread
    )
    _compat.trace_artifact("tessera_split_graph", lambda: split_dump)
    if split_model.dumps is not None:
        split_model.dumps.traced_graph(_compat.graph_source(gm))
        split_model.dumps.split_graph(split_dump)
        if factors is not None:
            split_model.dumps.factors(factors)
    split_model.listed_shapes = read = read_shapes(gm, config.shapes, not _every_size(split_model))
    if config.shapes and not read.values and read.dynamic_dims > 1:
        warnings.warn(
            f"{prefix}: no shape in compile_sizes fits this trace, whose input {input_text(read)} varies "
            f"in {read.dynamic_dims} dims ({describe(read)}); a shape gives the sizes of the dims that "
            "vary, in order (batch x length), so none is compiled here",
            TesseraWarning,
            stacklevel=2,
        )
    _build_pieces(split_model, gm, split_gm, items, example_inputs, start)
    return split_model


def _build_pieces(
    split_model: SplitModel,
    gm: torch.fx.GraphModule,
    split_gm: torch.fx.GraphModule,
    items: Sequence[SplitItem],
    example_inputs: Sequence[Any],
    start: float,
) -> None:
    """Install a runner for every piece of the split module (from_trace's second half)."""
    split_model.split_gm = split_gm
    split_model.pieces.place(items)
    counters.bump("pieces", len(items))
    counters.bump("compiled_pieces", sum(not item.is_splitting for item in items))
    log.debug(
        "traced graph of %d nodes split into %d piece(s) (%d compiled)",
        len(gm.graph.nodes),
        len(items),
        sum(not item.is_splitting for item in items),
    )
    for item in items:
        if item.is_splitting:
            # The split module calls split_model.submod_N(...): an instance attribute shadows the
            # submodule, so calls go straight to ours while the GraphModule stays printable.
            kept = split_model.pieces.layout_kept(item.name, item.graph.forward, output_layout(item.graph))
            split_gm.__dict__[item.name] = kept
    built = time.perf_counter()
    split_model.phases["split"] = built - start
    calls = piece_calls(split_gm, items, list(example_inputs))
    # The guards the trace holds now are its call check's: what a compile adds to them later is
    # that compile's own assumption, checked by its piece (_compat.compile_assumptions).
    _compat.note_trace(list(example_inputs))
    later = _background(split_model)
    needed = {
        index_key(s, item.index, split_model.compiler.name)
        for item, fake, _ in calls
        for s in (_sizes(split_model, fake)[:1] if later else _sizes(split_model, fake))
    }
    split_model.pool = _compile_pool(split_model, [fake for _, fake, _ in calls])
    # Up front with workers: every general artifact here first, then the rest at once, the
    # static sizes in the workers (as in the background, but before the first output).
    rest_now = not later and split_model.pool is not None
    entry = split_model.artifact_cache.entry
    if entry is None:
        turn: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    elif serves_traced(split_model):
        # Nothing here waits for the fleet: what it has is loaded, the rest serves as traced and
        # compiles in the background compile's turn (schedule.py), where a replica waits.
        turn = prefetch(entry, needed, split_model.remote)
    else:
        turn = compile_turn(entry, needed, split_model.remote)
    progress = CompileProgress(split_model.prefix, len(needed))
    try:
        with COMPILE_LOCK, turn:
            sendable = any(not _compat.ops_of_the_users(item.graph) for item, _, _ in calls)
            if split_model.pool is not None and sendable and split_model.artifact_cache.lacks(needed):
                # Started now (after the fleet's turn: what it published is in the index), so that
                # the workers import Inductor while the first artifacts compile. A warm start
                # starts none; sizes missing later start them with their first job.
                split_model.pool.start()
            try:
                for item, fake_args, real_args in calls:
                    _build(
                        split_model,
                        split_gm,
                        item,
                        fake_args,
                        real_args,
                        progress,
                        general_only=later or rest_now,
                    )
                if rest_now:
                    split_model.background.compile_all(progress)
            finally:
                # One index write for the turn (not one per piece or link: that made a cold
                # start quadratic in the layers), before the turn lets sibling ranks read it.
                split_model.artifact_cache.flush()
    finally:
        progress.close()
    if not split_model.background.left():
        split_model.background.ready.set()
    split_model.learning.start()
    split_model.phases["compile"] = time.perf_counter() - built
    log.debug(
        "built %d piece runner(s) in %.2fs", len(split_model.pieces.runners()), split_model.phases["compile"]
    )
    # forward, not __call__: skips nn.Module call machinery on every step.
    split_model.split_forward = split_gm.forward


def _build(
    split_model: SplitModel,
    split_gm: torch.fx.GraphModule,
    item: SplitItem,
    fake_args: Sequence[Any],
    real_args: Sequence[Any | None],
    progress: CompileProgress,
    general_only: bool = False,
) -> None:
    """Compile (or load) every artifact of one non-splitting piece and install its runner;
    ``general_only``: the general one now, the sizes and ranges left for the background."""
    config = split_model.config
    output = next(iter(reversed(item.graph.graph.nodes)))
    returns_tuple = isinstance(output.args[0], (tuple, list))
    source = find_size_source(fake_args)
    sizes = _sizes(split_model, fake_args)
    # Several dynamic sizes (batch x length): where each is read, for the shapes listed or learnt.
    shaped = split_model.config.auto_sizes or any(isinstance(s, Shape) for s in sizes)
    shapes = shape_sources(fake_args) if source is not None and shaped else ()
    content = piece_content(item.graph, fake_args)
    split_model.pieces[item.name].content = content
    now = sizes[:1] if general_only else sizes
    found = None
    if general_only and serves_traced(split_model):
        found = split_model.artifact_cache.find(
            item.graph, now[0], item.index, split_model.artifact_cache.content_key(content, now[0])
        )
        if found is None:
            # The first output waits for the trace alone: the piece runs as traced, the same
            # kernels as eager, until its general artifact (compiled first) is swapped in.
            now = ()
    work = PieceWork(item, fake_args, real_args, content)
    if source is not None:
        split_model.learning.sized.append(work)
    split_model.background.jobs.extend(Job(work, size) for size in sizes[len(now) :])
    artifacts: dict[Size, Callable[..., Any]] = {} if now else {None: item.graph.forward}
    seconds = []
    timings = []
    for size in now:
        progress.start(item.name, size_label(size))
        outcome = found or split_model.artifact_cache.get(
            item.graph,
            work.inputs(size),
            size,
            item.index,
            split_model.artifact_cache.content_key(content, size),
        )
        progress.advance()
        split_model.record_stage(item, size, outcome)
        artifacts[size] = outcome.fn
        split_model.note_obtained(item.name, size, outcome)
        seconds.append((size_label(size), outcome.seconds))
        timings.append(Timing(size_label(size), outcome.seconds, outcome.source))
    if timings:  # nothing obtained now: the piece serves as traced
        progress.piece_done(item.name, timings)
    returned = output.args[0] if returns_tuple else [output.args[0]]
    outputs = [a.meta.get("example_value") if isinstance(a, torch.fx.Node) else a for a in returned]
    record = PieceRecord(
        name=item.name,
        index=item.index,
        is_splitting=False,
        sym_positions=tuple(i for i, a in enumerate(fake_args) if isinstance(a, torch.SymInt)),
        returns_tuple=returns_tuple,
        size_source=source,
        sizes=tuple(s for s in sizes if isinstance(s, int | Shape)),
        ranges=tuple(config.ranges) if source is not None else (),
        compile_seconds=tuple(seconds),
        dynamic=dynamic_inputs(fake_args, outputs),
        partitions=partitions_of(split_model.compiler, artifacts.get(None)),
        shape_sources=shapes,
        inputs=saved_inputs(fake_args, size_symbols(fake_args))
        if source is not None and config.auto_sizes
        else None,
    )
    runner = PieceRunner(
        item.name, artifacts, source, config.max_size, traced_general=not now, shape_sources=shapes
    )
    runner.as_traced = item.graph.forward
    split_gm.__dict__[item.name] = split_model.pieces.install_runner(record, runner)


def serves_traced(split_model: SplitModel) -> bool:
    """Whether pieces whose general artifact is not in the cache serve as traced until it is.
    With a remote tier too: the fleet's compile turn is then the background compile's, so a
    replica serves while the lease holder compiles, and loads what it publishes."""
    return (
        split_model.serve_traced
        and _background(split_model)
        and split_model.config.serve_while_compiling
        and split_model.compiler.name != "eager"
    )


def _background(split_model: SplitModel) -> bool:
    """Whether sizes and ranges compile after the first output. Not with CUDA graphs (a
    captured graph holds the artifact it was captured with)."""
    return split_model.config.background_compile and split_model.pieces.graph_pool is None


def _compile_pool(split_model: SplitModel, pieces_args: list[Sequence[Any]]) -> CompilePool | None:
    """The compile workers, when some of this model can go to them (``fan_out.workers_for``):
    CPU pieces with a size and static compile sizes for them, or CPU pieces whose general artifacts
    compile in the background while they serve as traced."""
    on_cpu = [fake for fake in pieces_args if _on_cpu(fake)]
    sized = compile_sizes(split_model) and any(find_size_source(fake) is not None for fake in on_cpu)
    general = bool(on_cpu) and serves_traced(split_model)
    if not (sized or general):
        return None
    return workers_for(split_model, split_model.pieces.graph_pool, general)


def _sizes(split_model: SplitModel, fake_args: Sequence[Any]) -> tuple[Size, ...]:
    """What a piece is compiled for: general, then each static size (listed, or read from the
    listed shapes) and range if it has a size."""
    if find_size_source(fake_args) is None:
        return (None,)
    return (None, *piece_sizes(split_model, fake_args), *split_model.config.ranges)


def piece_sizes(split_model: SplitModel, fake_args: Sequence[Any]) -> tuple[int | Shape, ...]:
    """The static sizes of one piece: the listed sizes where it varies in one size, and what the
    listed shapes give it (listed_shapes.py). A Shape only where each of its sizes can be read
    from its inputs (what a call is dispatched on)."""
    symbols = size_symbols(fake_args)
    listed: tuple[int, ...] = ()
    if len(symbols) == 1:
        listed = compile_sizes(split_model)
    elif compile_sizes(split_model):
        _warn_sizes_need_shapes(split_model, symbols)
    shaped = piece_statics(split_model.listed_shapes, symbols)
    if len(symbols) > 1 and not shape_sources(fake_args):
        shaped = ()
    return (*listed, *(s for s in shaped if s not in listed))


def compile_sizes(split_model: SplitModel) -> tuple[int, ...]:
    """The compile sizes this trace serves: every size for an unbacked or size-oblivious
    trace; sizes >= 2 for a trace Dynamo specialised at 0 and 1 (those have traces of their own)."""
    if _every_size(split_model):
        return split_model.config.sizes
    return tuple(s for s in split_model.config.sizes if s >= 2)


def _every_size(split_model: SplitModel) -> bool:
    """Whether this trace serves sizes 0 and 1 too (unbacked or size-oblivious)."""
    return split_model.config.dynamic_shapes == "unbacked" or split_model.state.size_oblivious


def _warn_sizes_need_shapes(split_model: SplitModel, symbols: Sequence[Any]) -> None:
    """Listed sizes name one dynamic size; this trace's pieces vary in several: said once."""
    if split_model.warned_sizes:
        return
    split_model.warned_sizes = True
    where = f" (its input: {input_text(split_model.listed_shapes)})"
    warnings.warn(
        f"{split_model.prefix}: compile_sizes {list(compile_sizes(split_model))} give one dynamic size, "
        f"but this trace's pieces vary in {len(symbols)}, so those sizes are not compiled for them. "
        f"List shapes instead, one value per dim of the model's input that varies{where}: "
        "compile_sizes=[(4, 128), ...] (batch x length), or 'auto' to learn them",
        TesseraWarning,
        stacklevel=2,
    )


def _on_cpu(fake_args: Sequence[Any]) -> bool:
    """Whether a piece's compiles can go to a compile worker: its inputs are on the CPU (see
    InductorCompiler.job)."""
    return all(not isinstance(a, torch.Tensor) or a.device.type == "cpu" for a in fake_args)
