"""The warm start: every trace of a model saved for the next process, and loaded by it.

``save`` writes one trace's whole-model artifact into its cache entry and adds the entry to the
traces its fingerprint leads to (``<root>/warm/<fingerprint>.json``, cache/artifact.py); ``load``
rebuilds every one of them without Dynamo. A trace that does not load here is skipped (counted,
and said once when it is not damage or a changed model); the others still serve.
"""

from __future__ import annotations

import logging
import pickle
import time
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import filelock
import torch

from tessera import counters
from tessera.cache import pointer
from tessera.cache.entry import CacheEntry, warn_write_failed
from tessera.cache.fleet import publish
from tessera.cache.index import index_key
from tessera.cache.pointer import OtherPath
from tessera.cache.refusal import Refused
from tessera.cache.remote import RemoteTier
from tessera.compilation import graph_pickle
from tessera.compilation.compilers import Compiler, loads_without_graph, make_compiler
from tessera.compilation.piece import PieceRecord, PieceRunner
from tessera.config import CompileConfig, Counted, Shape, Size, size_label, static_size
from tessera.errors import CompilerError, FallbackWarning
from tessera.serving.size_learning import LoadedWork
from tessera.serving.split_model import ArtifactFate, ArtifactState, SplitModel
from tessera.trace import model_artifact
from tessera.trace.call_check import CallSpec
from tessera.trace.model_artifact import ModelArtifact
from tessera.trace.portable import capture_code, rebuild_call

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavedTrace:
    """One trace rebuilt from its whole-model artifact."""

    split_model: SplitModel
    call: Callable[..., Any]  # call(target, *args, **kwargs): Dynamo's bytecode, rebuilt
    spec: CallSpec
    reason: str  # why the process that made it traced it


@dataclass(frozen=True)
class WarmLoad:
    """What ``load`` found: the traces that rebuilt here, why the last one that did not was
    refused (None: all did, or there were none), and the path an earlier process recorded the
    model to run on instead (None: the traced path)."""

    traces: tuple[SavedTrace, ...] = ()
    refused: str | None = None
    other_path: OtherPath | None = None


@dataclass(frozen=True)
class Rebuilt:
    """One entry's whole-model artifact rebuilt: its split_model, and for each trace key it holds
    that binds here, the traced frame's callable and what the trace assumed of a call."""

    split_model: SplitModel
    calls: dict[str, tuple[Callable[..., Any], CallSpec]]


def load(
    config: CompileConfig,
    root: Path,
    prefix: str,
    fingerprint: str,
    traced_fn: types.FunctionType,
) -> WarmLoad:
    """Every saved trace of ``fingerprint`` that rebuilds here, or why none did. A compiler whose
    loader fails on a sound file raises CompilerError (tracing again would not cure it)."""
    listed = pointer.read_entries(root, fingerprint)
    if isinstance(listed, OtherPath):
        return WarmLoad(refused=str(listed), other_path=listed)
    if isinstance(listed, Refused):
        counters.bump("warm_start_fallbacks")
        return WarmLoad(refused=listed.reason)
    learnt = pointer.read_learnt(root, fingerprint)
    saved: list[SavedTrace] = []
    refused = None if listed else "no whole-model artifact for this model yet"
    # Traces of one graph share an entry (and its pieces): each entry is rebuilt once.
    by_entry: dict[Path, list[tuple[str, str]]] = {}
    for trace in listed:
        by_entry.setdefault(trace.entry, []).append((trace.model_sha, trace.reason))
    for entry_path, traces in by_entry.items():
        rebuilt = rebuild(
            config,
            make_compiler(config.backend),  # one per entry: a compiler writes into one entry
            root,
            prefix,
            entry_path,
            traced_fn,
            [key for key, _ in traces],
            learnt.get(entry_path, ()),
        )
        if isinstance(rebuilt, Refused):
            counters.bump("warm_start_fallbacks")
            refused = rebuilt.reason
            log.info("%s: a saved trace does not load (%s)", prefix, rebuilt)
            continue
        calls = rebuilt.calls
        for key, reason in traces:
            if key in calls or (not key and len(calls) == 1):
                call, spec = calls[key] if key in calls else next(iter(calls.values()))
                saved.append(SavedTrace(rebuilt.split_model, call, spec, reason))
    return WarmLoad(tuple(saved), refused)


def save(
    split_model: SplitModel,
    root: Path,
    fingerprint: str,
    traced_fn: types.FunctionType,
    code: types.CodeType,
    spec: CallSpec,
    reason: str,
    remote: RemoteTier | None,
    plan: dict[str, list[Any]],
    superseded: bool = False,
) -> None:
    """After a trace, once every size is compiled: its artifact, the fingerprint's pointer and
    the trace plan beside it, and with a remote tier all of them for the fleet. ``superseded``: a
    later trace widened it (pointer.write_pointer)."""
    saved = save_artifact(split_model, fingerprint, traced_fn, code, spec, reason, superseded)
    save_plan(root, fingerprint, plan)  # after the pointer it goes in (an earlier trace's, if not saved)
    if saved and remote is not None and split_model.entry is not None:
        publish(remote, root, fingerprint, split_model.entry, superseded=superseded)


def save_entry(
    context: Any, traced_fn: types.FunctionType, entry: Any, plan: dict[str, Any], superseded: bool = False
) -> None:
    """Once every size of a trace (``trace_entry.TraceEntry``) made here is compiled: its
    whole-model artifact and pointer, for the next process (``save``; ``superseded``: a later
    trace widened it)."""
    if context.root is None or context.fingerprint is None or entry.code is None:
        return
    save(
        entry.split_model,
        context.root,
        context.fingerprint,
        traced_fn,
        entry.code,
        entry.spec,
        entry.reason,
        context.remote,
        plan,
        superseded,
    )


def save_sizes(root: Path, fingerprint: str, remote: RemoteTier | None, split_model: SplitModel) -> None:
    """After a size is learnt or retired: the learnt sizes beside the fingerprint's traces (and,
    with a remote tier, the entry's new artifacts and the pointer), for the next process."""
    entry = split_model.entry
    if entry is None:
        return
    try:
        pointer.write_learnt(root, fingerprint, entry.path, split_model.learning.learnt_sizes)
    except OSError as e:  # the sizes serve here; the next process learns them again
        warn_write_failed(entry.path, e)
        return
    if remote is not None:
        publish(remote, root, fingerprint, entry, grown=True)


def save_plan(root: Path, fingerprint: str, plan: dict[str, list[Any]]) -> None:
    """What the model's traces found changing, for the next process (its new traces start wide)."""
    try:
        pointer.write_plan(root, fingerprint, plan)
    except OSError as e:  # the next process finds the dims again, a trace each
        log.debug("%s: trace plan not saved (%s)", fingerprint[:12], e)


def load_plan(root: Path, fingerprint: str) -> dict[str, list[Any]]:
    return pointer.read_plan(root, fingerprint)


# -- one entry's whole-model artifact: rebuilt into a split_model, written from one ----------------
def rebuild(
    config: CompileConfig,
    compiler: Compiler,
    cache_root: Path,
    prefix: str,
    entry_path: Path,
    traced_fn: types.FunctionType,
    keys: Sequence[str],
    learnt: Sequence[Counted] = (),
) -> Rebuilt | Refused:
    """A complete split_model rebuilt from the whole-model artifact in ``entry_path``, with the traces
    ``keys`` names that it holds and that bind here; or why not, without side effects on any
    other split_model. ``learnt``: the sizes an earlier process learnt from traffic, loaded where the
    entry holds them. A compiler whose ``load`` fails on a sound file raises ``CompilerError``
    (see artifact_cache.py): tracing again would not cure it.
    """
    start = time.perf_counter()
    entry = CacheEntry.open_existing(entry_path)
    data = entry if isinstance(entry, Refused) else entry.read_model()
    if isinstance(data, Refused):
        return Refused(f"entry {entry_path} is not usable: {data}")
    assert isinstance(entry, CacheEntry)
    read = time.perf_counter()
    saved = model_artifact.loads(data)
    if isinstance(saved, Refused):
        return saved
    variants = [v for v in saved.variants if v.key in keys or not any(keys)]
    if not variants:
        return Refused(f"entry {entry_path} no longer holds the trace its pointer names")
    for variant in variants:
        unbound = model_artifact.check_binds(variant)
        if unbound is not None:
            return unbound
    split_model = SplitModel(
        config,
        compiler,
        cache_root,
        prefix,
        entry=entry,
        sources=saved.sources,
        phases={"read_and_verify": read - start, "unpickle": time.perf_counter() - read},
    )
    split_model.artifact_fate = ArtifactFate(ArtifactState.LOADED)
    try:
        forward = _install_saved(split_model, saved, learnt)
        if isinstance(forward, Refused):
            return forward
        calls: dict[str, tuple[Callable[..., Any], CallSpec]] = {}
        for variant in variants:
            call = rebuild_call(variant.code, traced_fn, forward)
            if isinstance(call, Refused):
                return call
            calls[variant.key] = (call, variant.call_spec)
    except CompilerError:  # a loader's failure: not cured by a trace
        raise
    except Exception as e:  # whatever else stops the rebuild costs one trace, never the process
        reason = f"the artifact does not rebuild here ({type(e).__name__}: {e})"
        _warn_bug_once(reason, entry_path)
        return Refused(reason)
    split_model.phases["rebuild_code"] = time.perf_counter() - start - sum(split_model.phases.values())
    counters.bump("pieces", len(split_model.pieces))
    counters.bump("compiled_pieces", len(saved.pieces))
    split_model.background.ready.set()  # every size was in the artifact
    return Rebuilt(split_model, calls)


def _install_saved(
    split_model: SplitModel, saved: ModelArtifact, learnt: Sequence[Counted] = ()
) -> Callable[..., Any] | Refused:
    """Runners, splitting pieces and the split module's forward from a whole-model artifact
    (and the ``learnt`` sizes it holds artifacts for); or why a piece does not load."""
    start = time.perf_counter()
    graphs = {content: blob for content, blob in saved.graphs}
    graph_of = dict(saved.piece_graphs)
    unpickled: dict[str, torch.fx.GraphModule] = {}
    needs_graph = not loads_without_graph(split_model.compiler)
    attributes: dict[str, Any] = {}
    loaded_learnt: set[Counted] = set()
    unlearnable: list[str] = []  # sized pieces a learnt size could not compile
    runners: dict[str, PieceRunner] = {}
    splitting = {name for name, _ in saved.modules}
    names = sorted([*splitting, *(r.name for r in saved.pieces)], key=lambda n: int(n.rsplit("_", 1)[1]))
    split_model.pieces.place_names(names, splitting)
    for record in saved.pieces:
        graph = None
        if needs_graph:
            content = graph_of.get(record.name)
            if content is None:
                return Refused(f"{record.name}: its graph was not saved")
            if content not in unpickled:  # identical pieces share one graph
                unpickled[content] = graph_pickle.load_graph(graphs[content])
            graph = unpickled[content]
        artifacts: dict[Size, Callable[..., Any]] = {}
        for size in (None, *record.sizes, *record.ranges):
            outcome = split_model.artifact_cache.load_only(graph, size, record.index)  # type: ignore[arg-type]
            if isinstance(outcome, Refused):
                return Refused(f"{record.name} ({size_label(size)}): {outcome}")
            artifacts[size] = outcome.fn
            split_model.note_obtained(record.name, size, outcome)
        for counted in learnt if record.size_source is not None else ():
            static = static_size(counted)
            if isinstance(static, Shape) != bool(record.shape_sources) or (
                isinstance(static, Shape) and len(static.values) != len(record.shape_sources)
            ):
                continue  # a shape is learnt for the pieces with that many sizes, a size for the others
            if static in artifacts or (
                isinstance(static, int)
                and split_model.config.max_size is not None
                and static > split_model.config.max_size
            ):
                continue
            found = split_model.artifact_cache.load_only(graph, static, record.index)  # type: ignore[arg-type]
            if isinstance(found, Refused):  # not in this entry (yet): the general artifact serves it
                log.debug("%s: learnt %s not loaded (%s)", record.name, size_label(static), found)
                continue
            artifacts[static] = found.fn
            split_model.note_obtained(record.name, static, found)
            loaded_learnt.add(counted)
        content = graph_of.get(record.name)
        if split_model.config.auto_sizes and record.inputs is not None and content in graphs:
            # What a size this process learns compiles from (the graph unpickled only then).
            split_model.learning.loaded.append(LoadedWork(record, content, graphs[content], unpickled))
        elif split_model.config.auto_sizes and record.size_source is not None:
            unlearnable.append(record.name)
        runner = PieceRunner(
            record.name,
            artifacts,
            record.size_source,
            split_model.config.max_size,
            shape_sources=record.shape_sources,
        )
        if runner.guarded():  # a call outside what a compile assumed runs the graph as traced
            if content not in graphs:
                return Refused(f"{record.name}: its graph was not saved, and a call may need it")
            runner.as_traced = _traced_later(content, graphs, unpickled)
        runners[record.name] = runner
        attributes[record.name] = split_model.pieces.install_runner(record, runner)
    if unlearnable and split_model.learning.loaded:
        # A size is learnt for every sized piece or none (as a traced process decides).
        log.info(
            "%s: auto sizes: piece(s) %s were saved without their inputs or graph, so this process "
            "learns no size (a process that traces the model does)",
            split_model.prefix,
            ", ".join(unlearnable),
        )
        split_model.learning.loaded.clear()
    for work in split_model.learning.loaded:  # its weights from the piece's first call
        runners[work.record.name].keep_inputs = work.keep
    loaded = time.perf_counter()
    split_model.phases["load_kernels"] = loaded - start
    built: dict[str, Callable[..., Any]] = {}
    layouts = dict(saved.layouts)
    for name, module in saved.modules:
        if module.source not in built:  # identical splitting pieces: one exec
            built[module.source] = module.build({})
        attributes[name] = split_model.pieces.layout_kept(name, built[module.source], layouts.get(name))
    forward = saved.split_module.build(attributes)
    split_model.split_forward = forward
    if split_model.config.auto_sizes and split_model.config.cudagraph_capture_sizes is None:
        split_model.pieces.add_capture_sizes(sorted(s for s in loaded_learnt if isinstance(s, int)))
    split_model.learning.start(sorted(loaded_learnt, key=list(learnt).index))
    return forward


def _traced_later(
    content: str, graphs: dict[str, bytes], unpickled: dict[str, torch.fx.GraphModule]
) -> Callable[..., Any]:
    """A piece's graph as traced, unpickled at its first call (most processes never make one)."""

    def as_traced(*args: Any) -> Any:
        graph = unpickled.get(content)
        if graph is None:
            graph = unpickled.setdefault(content, graph_pickle.load_graph(graphs[content]))
        return graph(*args)

    return as_traced


def save_artifact(
    split_model: SplitModel,
    fingerprint: str,
    traced_fn: types.FunctionType,
    code: types.CodeType,
    spec: CallSpec,
    reason: str = "the first call",
    superseded: bool = False,
) -> bool:
    """After a trace: write the whole-model artifact and add it to the fingerprint's pointer
    (``reason``: why the trace was made; ``superseded``: a later trace widened it). Whether both
    were written."""
    entry, split_gm = split_model.entry, split_model.split_gm
    if entry is None or split_gm is None or split_model.cache_root is None:
        return False
    start = time.perf_counter()
    pieces = list(split_model.pieces)
    unsaved = [p.name for p in pieces if not p.is_splitting and not _saved(split_model, p.record)]
    if unsaved:
        split_model.artifact_fate = _not_written(
            f"{unsaved} were not saved by compiler {split_model.compiler.name}"
        )
        log.info("no whole-model artifact: %s", split_model.artifact_fate)
        return False
    portable = capture_code(code, traced_fn)
    if isinstance(portable, Refused):
        split_model.artifact_fate = _not_written(portable.reason)
        log.info("no whole-model artifact (the next process traces again): %s", portable)
        return False
    try:
        saved: ModelArtifact = model_artifact.make(
            portable,
            split_gm,
            [p.record for p in pieces if p.record is not None],
            [p.name for p in pieces if p.is_splitting],
            [(p.name, p.layout) for p in pieces if p.is_splitting],
            split_model.sources,
            {
                p.name: p.content or ""
                for p in pieces
                if not p.is_splitting
                and (
                    not loads_without_graph(split_model.compiler)
                    or split_model.config.auto_sizes
                    or (p.runner is not None and p.runner.guarded())  # runs as traced outside them
                )
            },
            spec,
            # Kept for the sizes a warm process learns (auto sizes) only: as Inductor is given them.
            laid_out=loads_without_graph(split_model.compiler),
        )
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        split_model.artifact_fate = _not_written(str(e))
        log.info("no whole-model artifact (the next process traces again): %s", e)
        return False
    try:
        with filelock.FileLock(str(entry.path / ".model.lock")):
            # Another trace of this model with the same graph may be saved there: kept.
            saved = saved.with_variants_of(_saved_artifact(entry))
            blob = model_artifact.dumps(saved)
            entry.write_model(blob)
    except OSError as e:  # the model runs; the next process traces again
        split_model.artifact_fate = _not_written(str(e.strerror))
        warn_write_failed(entry.path, e)
        return False
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        # What the call check compares against includes a value that cannot be saved (a class
        # defined inside a function): this process runs; the next one traces again.
        split_model.artifact_fate = _not_written(f"the call check holds a value that cannot be saved ({e})")
        log.info("no whole-model artifact (the next process traces again): %s", e)
        return False
    try:
        key = saved.variants[-1].key
        pointer.write_pointer(split_model.cache_root, fingerprint, entry.path, reason, key, superseded)
    except OSError as e:  # the model runs; the next process traces again
        split_model.artifact_fate = _not_written(str(e.strerror))
        warn_write_failed(entry.path, e)
        return False
    split_model.artifact_fate = ArtifactFate(ArtifactState.WRITTEN)
    split_model.phases["whole_model_artifact"] = time.perf_counter() - start
    return True


def _saved(split_model: SplitModel, record: PieceRecord | None) -> bool:
    """Whether every artifact of a compiled piece is recorded in the split_model's entry."""
    if record is None or split_model.entry is None:
        return False
    entries = split_model.entry.index.entries
    return all(
        index_key(size, record.index, split_model.compiler.name) in entries
        for size in (None, *record.sizes, *record.ranges)
    )


def _saved_artifact(entry: CacheEntry) -> ModelArtifact | None:
    """The whole-model artifact the entry holds now, if it loads."""
    data = entry.read_model()
    loaded = data if isinstance(data, Refused) else model_artifact.loads(data)
    return None if isinstance(loaded, Refused) else loaded


def _not_written(reason: str) -> ArtifactFate:
    return ArtifactFate(ArtifactState.NOT_WRITTEN, reason)


_WARNED_BUGS: set[str] = set()  # rebuild failures already warned about by this process


def _warn_bug_once(reason: str, entry_path: Path) -> None:
    """One FallbackWarning per distinct failure per process (each is counted, warned or not)."""
    if reason in _WARNED_BUGS:
        return
    _WARNED_BUGS.add(reason)
    warnings.warn(
        f"tessera: the whole-model artifact in {entry_path} was not used: {reason}. This is neither "
        "damage nor a changed model, so it is likely a bug; the model was traced instead and results "
        "are unaffected. Please report it with this message",
        FallbackWarning,
        stacklevel=4,
    )
