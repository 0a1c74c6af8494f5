"""The compile record of one model: what was compiled or loaded, from where, and what it cost.

``compiled.report`` returns a ``CompileReport`` (frozen): the same data ``on_compiled`` receives,
``tessera report`` renders and a service can export (``as_dict``).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from tessera.config import CompileConfig, Counted, by_size, size_label

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArtifactReport:
    """One artifact of one piece: how it was obtained and how many calls it has served."""

    piece: str
    size: str  # "general", "size 16", "range [9,32]"
    source: str  # "compiled", "loaded" (from the cache), "shared" (an identical piece's)
    seconds: float
    file: str  # relative to the cache entry; "" when nothing is on disk
    bytes: int
    served: int = 0
    worker: int | None = None  # the pid of the compile worker that compiled it (None: this process)


@dataclass(frozen=True)
class Fallback:
    """A faster path not taken, and why: a named event, counted in ``tessera.counters``
    (``artifact_fallbacks``: a piece obtained again; ``warm_start_fallbacks``: a trace)."""

    what: str  # "piece artifact" (obtained again) or "whole-model artifact" (traced instead)
    subject: str  # which: "piece 3 (general): artifacts/ab12.bin", or the entry
    cause: str  # "damage" (the file), "untrusted" (its owner or mode), "bug" (an unexpected error)
    reason: str


@dataclass(frozen=True)
class GraphReport:
    """One graph Dynamo handed to tessera on the guarded path (graph breaks, torch.compile):
    where and why Dynamo ended it, and what tessera made of it."""

    index: int  # in the order compiled in this process
    reason: str  # why Dynamo ended the graph: the graph break's cause, or how the frame returned
    source: str  # "file.py:12 in forward": the break's user line ("" when Dynamo names none)
    graph_break: bool  # False: the graph ran to the end of its frame
    nodes: int
    pieces: int
    cache_entry: str | None


class GuardedGraph(NamedTuple):
    """One graph of the guarded path and the SplitModel that compiled it."""

    report: GraphReport
    split_model: Any


class TraceSpan(NamedTuple):
    """One trace made in this process: its name, wall-clock start and seconds."""

    name: str
    started: float
    seconds: float


@dataclass(frozen=True)
class TraceReport:
    """One trace a model holds (traces.py): why it was made, and whether it was loaded."""

    number: int  # in the order this process made or loaded them, from 1
    reason: str  # "the first call", or the assumption of the nearest trace the call broke
    source: str  # "traced" (Dynamo ran in this process) or "loaded" (the whole-model artifact)
    cache_entry: str | None


@dataclass(frozen=True)
class Span:
    """One step of a model's compile on the process's time axis: a trace, or one artifact of
    one piece obtained (compiled, loaded or shared)."""

    what: str  # "trace 1", "general", "size 16", "range [9,32]"
    piece: str  # "" for a trace
    source: str  # "traced", "compiled", "loaded", "shared"
    start: float  # seconds from the process's start
    end: float


@dataclass(frozen=True)
class CompileReport:
    """Cold or warm, seconds per phase, every artifact, this model's counters, the cache entry."""

    model: str
    kind: str  # "cold" (something was compiled or traced) or "warm" (loaded, no trace)
    mode: str
    backend: str
    phases: tuple[tuple[str, float], ...]  # ("trace", s), ("compile", s), ("first_call", s), ...
    artifacts: tuple[ArtifactReport, ...]
    pieces: int
    compiled_pieces: int
    counters: tuple[tuple[str, int], ...]  # this model's share of tessera.counters
    cache_entry: str | None
    whole_model_artifact: str  # "loaded", "written", or why neither
    total_seconds: float
    graphs: tuple[GraphReport, ...] = ()  # the guarded path (graph breaks): each graph Dynamo made
    # Serve first, specialise after: the sizes and ranges compiled after the first output.
    background: str = "none"  # "none", "running", "done", or "failed: <why>"
    all_sizes_ready_seconds: float | None = None  # from the first call's start; None until ready
    fallbacks: tuple[Fallback, ...] = ()  # piece artifacts the cache held but could not serve
    traces: tuple[TraceReport, ...] = ()  # every trace the model holds, and why each was made
    # The compile on one time axis (seconds from the process's start), in the order obtained.
    timeline: tuple[Span, ...] = ()
    # Every call's size and the artifact that served it: (size, artifact label, calls).
    sizes_served: tuple[tuple[Counted, str, int], ...] = ()
    learnt_sizes: tuple[Counted, ...] = ()  # sizes learnt from traffic (compile_sizes="auto") serving now

    def phase(self, name: str) -> float:
        """Seconds spent in phase ``name`` (0.0 if it did not happen)."""
        return dict(self.phases).get(name, 0.0)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: what ``tessera report --json`` prints."""
        data = dataclasses.asdict(self)
        data["phases"] = dict(self.phases)
        data["counters"] = dict(self.counters)
        return data

    def summary(self) -> str:
        """One line: the INFO log line of the first call."""
        compiled = sum(a.source == "compiled" for a in self.artifacts)
        loaded = sum(a.source == "loaded" for a in self.artifacts)
        shared = sum(a.source == "shared" for a in self.artifacts)
        breaks = sum(g.graph_break for g in self.graphs)
        graphs = f"{len(self.graphs)} graphs ({breaks} graph breaks), " if self.graphs else ""
        later = ""
        if self.background == "running" and any(a.source == "as traced" for a in self.artifacts):
            later = "; pieces serve as traced while they compile in the background"
        elif self.background == "running":
            later = "; sizes and ranges compiling in the background"
        elif self.background == "done" and self.all_sizes_ready_seconds is not None:
            later = f"; every size ready at {self.all_sizes_ready_seconds:.2f}s"
        elif self.background.startswith("failed"):
            later = f"; background compile {self.background}"
        traces = f"{len(self.traces)} traces, " if len(self.traces) > 1 else ""
        return (
            f"{self.model}: {self.kind} start in {self.total_seconds:.2f}s{later} ({graphs}{traces}"
            f"{self.pieces} pieces, {self.compiled_pieces} compiled by {self.backend}; "
            f"artifacts: {compiled} compiled, {shared} shared, {loaded} loaded; "
            f"whole-model artifact {self.whole_model_artifact}; {self._fallback_words()}"
            f"cache {self.cache_entry or 'disabled'})"
        )

    def _fallback_words(self) -> str:
        counts = dict(self.counters)
        warm, pieces = counts.get("warm_start_fallbacks", 0), counts.get("artifact_fallbacks", 0)
        if not (warm or pieces):
            return ""
        return f"fallbacks: {warm} warm start, {pieces} piece artifact(s); "


def counter_delta(before: Mapping[str, int], after: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The counters that changed between two snapshots, and by how much."""
    changed = ((name, after[name] - before.get(name, 0)) for name in after)
    return tuple((name, delta) for name, delta in changed if delta)


def build_report(
    model: str,
    config: CompileConfig,
    split_model: Any,
    phases: dict[str, float],
    counters: tuple[tuple[str, int], ...],
    total_seconds: float,
) -> CompileReport:
    """The record of a model's first call. ``split_model``: its ``SplitModel`` (None in modes
    without one); ``phases``: what the model measured itself (trace, first call, warm phases)."""
    artifacts: list[ArtifactReport] = []
    fallbacks: tuple[Fallback, ...] = ()
    if split_model is not None:
        # Copies first: a background compile may be adding to them.
        fallbacks = tuple(split_model.fallbacks)
        phases.update({k: v for k, v in dict(split_model.phases).items() if k not in phases})
        for obtained in list(split_model.obtained):
            piece, size, outcome = obtained.piece, obtained.size, obtained.outcome
            runner = split_model.pieces[piece].runner
            served = dict(runner.served()) if runner is not None else {}
            record = outcome.record
            artifacts.append(
                ArtifactReport(
                    piece=piece,
                    size=size_label(size),
                    source=outcome.source,
                    seconds=outcome.seconds,
                    file=record.file if record is not None else "",
                    bytes=record.size if record is not None else 0,
                    served=served.get(size_label(size), 0),
                    worker=outcome.worker,
                )
            )
        for piece, runner in split_model.pieces.runners().items():
            # Pieces that served as traced while their general artifact compiled (background).
            artifacts.extend(
                ArtifactReport(piece, label, "as traced", 0.0, file="", bytes=0, served=n)
                for label, n in runner.served_as_traced()
            )
    records = split_model.records() if split_model is not None else ()
    entry = split_model.entry if split_model is not None else None
    traced = any(name == "graphs_traced" and n for name, n in counters)
    compiled = any(a.source == "compiled" for a in artifacts)
    return CompileReport(
        model=model,
        kind="cold" if traced or compiled or split_model is None else "warm",
        mode=config.mode,
        backend=config.backend,
        phases=tuple(phases.items()),
        artifacts=tuple(artifacts),
        pieces=len(records),
        compiled_pieces=sum(not r.is_splitting for r in records),
        counters=counters,
        cache_entry=str(entry.path) if entry is not None else None,
        whole_model_artifact=str(split_model.artifact_fate)
        if split_model is not None
        else "not used in this mode",
        total_seconds=total_seconds,
        background=split_model.background.status if split_model is not None else "none",
        all_sizes_ready_seconds=_all_ready(split_model, total_seconds),
        fallbacks=fallbacks,
    )


@functools.cache
def process_start() -> float:
    """When this process started (wall-clock seconds): from ``/proc`` on Linux, else when tessera
    was imported."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        import tessera

        return tessera.IMPORTED_AT


def timeline(traces: Iterable[TraceSpan], split_models: Iterable[Any]) -> tuple[Span, ...]:
    """The spans of ``traces`` (name, wall-clock start, seconds) and of every artifact the
    ``split_models`` obtained, on one axis from the process's start, ordered by start."""
    zero = process_start()
    spans = [
        Span(name, "", "traced", start - zero, start - zero + seconds) for name, start, seconds in traces
    ]
    for split_model in split_models:
        for got in list(split_model.obtained):
            end = got.at - zero
            spans.append(
                Span(size_label(got.size), got.piece, got.outcome.source, end - got.outcome.seconds, end)
            )
    return tuple(sorted(spans, key=lambda s: (s.start, s.end)))


def sizes_served(split_models: Iterable[Any]) -> tuple[tuple[Counted, str, int], ...]:
    """(size, artifact label, calls) over the ``split_models``' counts, by size."""
    counts: dict[tuple[Counted, str], int] = {}
    for split_model in split_models:
        if split_model.learning.tally is not None:
            for size, label, n in split_model.learning.tally.histogram():
                counts[(size, label)] = counts.get((size, label), 0) + n
    return tuple(sorted(((size, label, n) for (size, label), n in counts.items()), key=by_size))


def _all_ready(split_model: Any, first_output: float) -> float | None:
    """Seconds from the first call's start until every size was in place (the background
    compile starts as the first output is returned)."""
    if split_model is None:
        return None
    phases = dict(split_model.phases)
    if "background_compile" in phases:
        return first_output + float(phases["background_compile"])
    return first_output if split_model.background.ready.is_set() else None


def merge_graph_reports(
    reports: list[CompileReport],
    graphs: tuple[GraphReport, ...],
    phases: dict[str, float],
    total_seconds: float,
) -> CompileReport:
    """One model's record on the guarded path: the reports of its graphs' split_models, together."""
    first = reports[0]
    return dataclasses.replace(
        first,
        # Dynamo traces in every process here: cold means something was compiled.
        kind="cold" if any(a.source == "compiled" for r in reports for a in r.artifacts) else "warm",
        phases=tuple(phases.items()),
        artifacts=tuple(
            dataclasses.replace(a, piece=f"graph {g.index}: {a.piece}")
            for r, g in zip(reports, graphs, strict=True)
            for a in r.artifacts
        ),
        pieces=sum(r.pieces for r in reports),
        compiled_pieces=sum(r.compiled_pieces for r in reports),
        fallbacks=tuple(f for r in reports for f in r.fallbacks),
        whole_model_artifact="not used with graph breaks (Dynamo traces in every process)",
        total_seconds=total_seconds,
        graphs=graphs,
    )


def save_report(entry: Path, kind: str, as_json: str) -> None:
    """Keep the record in the cache entry for ``tessera report`` (best effort: never fails)."""
    from tessera.cache.entry import atomic_write

    try:
        atomic_write(entry / f"report-{kind}.json", as_json.encode())
    except OSError as e:  # a read-only cache: the record stays in memory
        log.debug("compile record not saved in %s: %s", entry, e)


def model_report(
    name: str,
    config: CompileConfig,
    split_model: Any,
    graphs: list[GuardedGraph],
    traces: Any,
    phases: dict[str, float],
    counters: tuple[tuple[str, int], ...],
    first_call_seconds: float,
) -> CompileReport:
    """A compiled model's record: of its traces (``traces``: traces.Traces, with ``split_model`` the
    one serving now), or on the guarded path of every graph's pieces (``graphs``)."""
    if graphs:
        return merge_graph_reports(
            [build_report(name, config, b, {}, counters, 0.0) for _, b in graphs],
            tuple(r for r, _ in graphs),
            phases,
            first_call_seconds,
        )
    report = build_report(name, config, split_model, phases, counters, first_call_seconds)
    if traces is None:
        return report
    split_models = list({id(b): b for b in traces.split_models()}.values())
    return dataclasses.replace(
        report,
        traces=tuple(
            TraceReport(
                e.number,
                e.reason,
                "loaded" if e.loaded else "traced",
                str(e.split_model.entry.path) if e.split_model.entry is not None else None,
            )
            for e in traces.entries
        ),
        timeline=timeline([*_served_eagerly(traces), *traces.spans()], split_models),
        sizes_served=sizes_served(split_models),
        learnt_sizes=tuple(s for b in split_models for s in b.learning.learnt_sizes),
    )


def _served_eagerly(traces: Any) -> list[TraceSpan]:
    """The span of the calls served eagerly while traces were made beside them (beside.py)."""
    beside = getattr(traces, "beside", None)
    if beside is None or not beside.eager_calls:
        return []
    start, end = beside.eager_span
    return [TraceSpan(f"served eagerly ({beside.eager_calls} calls)", start, end - start)]


def publish(
    report: CompileReport,
    cache_dir: Path | None,
    later: Callable[[], CompileReport | None],
    on_compiled: Callable[[CompileReport], Any] | None,
) -> None:
    """A first call's report: to torch's trace log, saved with the cache entry (and again at exit,
    ``later()``: every size served since and what compiled after the first call, background and
    learnt sizes, what ``tessera report ENTRY --html`` draws), and given to ``on_compiled``."""
    from tessera import _compat

    as_json = json.dumps(report.as_dict(), indent=1)
    _compat.trace_artifact("tessera_compile_report", lambda: as_json, in_compile=False)
    if cache_dir is not None:
        save_report(cache_dir, report.kind, as_json)
        atexit.register(_save_at_exit, later, cache_dir, report.kind)
    if on_compiled is not None:
        on_compiled(report)


def _save_at_exit(later: Callable[[], CompileReport | None], cache_dir: Path, kind: str) -> None:
    try:
        report = later()
        if report is not None:
            as_dict = dataclasses.replace(report, kind=kind).as_dict()
            save_report(cache_dir, kind, json.dumps(as_dict, indent=1))
    except Exception as e:  # a record at exit is best effort: never an error at shutdown
        log.debug("compile record not saved at exit: %s", e)
