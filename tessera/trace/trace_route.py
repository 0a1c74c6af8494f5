"""Which of a model's traces covers a call (``covering``), the nearest one when none does, and
the refusal past ``max_traces``: the routing's decisions, apart from the entries' owner
(traces.py), which serves and traces."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from tessera import _compat
from tessera.compilation.layout import to_layout
from tessera.trace import call_args, call_check, call_shapes
from tessera.trace.assumption import Assumption, Kind, Mismatch
from tessera.trace.trace_entry import TraceEntry
from tessera.trace.trace_plan import changed_dims

Mismatches = list[Mismatch]


class Nearest(NamedTuple):
    """The entry a call differs least from (None: there is none), in words, and what it breaks."""

    entry: TraceEntry | None
    words: str
    mismatches: Mismatches


def covering(
    signature: inspect.Signature,
    ordered: list[TraceEntry],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    remember: Callable[[call_shapes.Shape, TraceEntry, call_args.Rewrite], None] | None,
) -> call_shapes.Routed[TraceEntry] | None:
    """The first of ``ordered`` that covers this call, and the call as it runs there: as passed,
    normalised to the entry's traced structure, or with an argument copied into its traced layout.
    ``remember``: told a call shape that differs from its entry's only in syntax (call_shapes.py)."""
    for entry in ordered:
        if entry.accepts(args, kwargs):
            return call_shapes.Routed(entry, args, kwargs)
    state = _compat.call_state()
    for entry in ordered:
        if entry.spec.global_state and entry.spec.global_state != state:
            continue  # traced under another autocast, default dtype or function mode
        try:
            rewrite = call_args.rewrite(signature, entry.spec, len(args), tuple(kwargs))
            n_args, n_kwargs = rewrite.apply(args, kwargs)
        except call_check.InputMismatchError:
            continue
        # The assumptions one by one: the quick check compares a tuple, where NaN != NaN. Only
        # a layout may be put right: the first other assumption broken rules the entry out (a
        # call of a size no entry covers reads a few, not every entry's hundreds).
        mismatches = entry.spec.mismatches(n_args, n_kwargs, entry.bound, until=_not_layout)
        if remember is not None and not mismatches and entry.accepts(n_args, n_kwargs):
            # Only the syntax differs: later calls of this shape skip this search.
            remember(call_shapes.shape_of(args, kwargs), entry, rewrite)
        if mismatches:
            if not all(call_check.layout_path(a) for a, _ in mismatches):
                continue
            n_args, n_kwargs = fix_layouts(entry, n_args, n_kwargs, mismatches)
            if entry.spec.mismatches(n_args, n_kwargs, entry.bound):
                continue
        return call_shapes.Routed(entry, n_args, n_kwargs)
    return None


def _not_layout(assumption: Assumption) -> bool:
    return call_check.layout_path(assumption) is None


def changed_since_every_entry(
    signature: inspect.Signature,
    entries: tuple[TraceEntry, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Mismatches:
    """What this call changed against every entry, not only the nearest: a size or an argument
    int that took another value in any trace is dynamic from now on, as Dynamo's automatic
    dynamic keeps one record of the sizes seen for all of a frame's graphs. (Widened by the
    nearest entry alone, a batch that changed between two decode steps stayed static in the
    cache's tensors, and every batch of a generate() loop was a trace of its own.)"""
    changed: list[Mismatch] = []
    for entry in entries:
        try:
            n_args, n_kwargs = call_args.normalise(signature, entry.spec, args, kwargs)
        except call_check.InputMismatchError:
            continue  # another structure: nothing to compare
        changed.extend(
            m
            for m in entry.spec.mismatches(n_args, n_kwargs, entry.bound)
            if m.assumption.kind is not Kind.FLOOR
        )
    return changed


def nearest(
    signature: inspect.Signature, ordered: list[TraceEntry], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Nearest:
    """The entry this call differs least from, in words, and the assumptions it breaks."""
    best: tuple[int, TraceEntry | None, str, Mismatches] | None = None
    state = _compat.call_state()
    for entry in ordered:
        candidate: tuple[int, TraceEntry | None, str, Mismatches]
        try:
            n_args, n_kwargs = call_args.normalise(signature, entry.spec, args, kwargs)
        except call_check.InputMismatchError as e:
            candidate = (10_000, entry, str(e), [])
        else:
            mismatches = entry.spec.mismatches(n_args, n_kwargs, entry.bound)
            words = call_check.explain(mismatches) if mismatches else ""
            if entry.spec.global_state and entry.spec.global_state != state:
                words = "; ".join(
                    w for w in (call_check.explain_state(entry.spec.global_state, state), words) if w
                )
            candidate = (len(mismatches), entry, words or "the call differs", mismatches)
        if best is None or candidate[0] < best[0]:
            best = candidate
    if best is None:
        return Nearest(None, "the first call", [])
    return Nearest(best[1], best[2], best[3])


def refusal(
    name: str,
    entries: tuple[TraceEntry, ...],
    limit: int,
    nearest: TraceEntry | None,
    reason: str,
    mismatches: Mismatches,
) -> call_check.InputMismatchError:
    """The error a call no entry covers gets once the model holds ``limit`` entries."""
    listed = "; ".join(f"trace {e.number}: {e.reason}" for e in entries)
    more = (
        "max_traces=1 traces once and refuses every call unlike the first: raise it to trace again"
        if limit == 1
        else f"raise max_traces (now {limit})"
    )
    advice = f"{call_check.advice(mismatches)}; or {more}; or use mode='stock' (Dynamo's guards)"
    state = _compat.call_state()
    kind = call_check.InputMismatchError
    if nearest is not None and nearest.spec.global_state and nearest.spec.global_state != state:
        kind = call_check.StateMismatchError
    return kind(
        f"{name}: no trace covers this call ({reason}), and the model holds "
        f"{len(entries)} trace(s), the limit ({listed}). To serve it: {advice}"
    )


def layout_of_written_input(entry: TraceEntry, mismatches: list[Mismatch]) -> bool:
    return (
        bool(mismatches)
        and entry.spec.writes_in_place
        and all(call_check.layout_path(a) for a, _ in mismatches)
    )


def fix_layouts(
    entry: TraceEntry,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mismatches: list[Mismatch],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Arguments whose only difference is their layout, copied into the traced layout (the
    compiled code assumes it). An argument the model writes to is not copied: the write would
    miss the caller's tensor, so the call is traced for its own layout instead."""
    positional, keywords = list(args), dict(kwargs)
    for assumption, _ in mismatches:
        path = call_check.layout_path(assumption)
        if path is None or path in entry.mutated or entry.spec.writes_in_place:
            continue
        kind, key = path
        if kind == "args" and isinstance(positional[int(key)], torch.Tensor):
            positional[int(key)] = to_layout(positional[int(key)], assumption.expected)
        elif kind == "kwargs" and isinstance(keywords.get(key), torch.Tensor):
            keywords[key] = to_layout(keywords[key], assumption.expected)
    return tuple(positional), keywords


def widened_from(entries: Sequence[TraceEntry], mismatches: Mismatches) -> TraceEntry | None:
    """The entry the newest one (``entries[-1]``) was traced from when it differs from it only by
    sizes it made dynamic (``mismatches``: what the call broke of it); None if there is none."""
    new = entries[-1] if entries else None
    if new is None or not mismatches:
        return None
    old = next((e for e in entries[:-1] if mismatches[0].assumption in e.spec.assumptions), None)
    if old is None or old.split_model is new.split_model:
        return None
    kept = {a.expr for a in new.spec.assumptions}
    widened = all(
        a.kind not in (Kind.FLOOR, Kind.STATE) and changed_dims(a, found) and a.expr not in kept
        for a, found in mismatches
    )
    return old if widened else None
