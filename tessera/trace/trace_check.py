"""The call check of a trace, read from Dynamo's guards while the trace is made (``recorder``):
what the trace assumed of a call, with the size floors of a size-oblivious trace."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from tessera import _compat
from tessera.trace import call_args, call_check, dynamo_guards
from tessera.trace.trace_entry import Model
from tessera.trace.trace_plan import size_floors
from tessera.trace.wrapper import DynamicChoice, TraceAgain

log = logging.getLogger(__name__)


class TracedAtOne(TraceAgain):
    """A size-oblivious trace made at a size one of its ops treats apart (size 1 for a squeeze)."""


def recorder(
    model: Model,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    choice: DynamicChoice,
    oblivious: bool,
    hinted: bool,
    dropped: Callable[[tuple[tuple[str, int], ...]], None],
) -> Callable[..., call_check.CallSpec]:
    """What reads Dynamo's guards into the call spec: called during the trace, after the graph
    is compiled and before the first call runs (so a model that appends to a list argument
    is checked against the list as passed). ``dropped``: told the guards the translation left out."""
    names = call_args.argument_names(model.signature, args, kwargs)
    dynamic: dict[str, set[int]] = {}
    for name, dim in choice.dims:
        dynamic.setdefault(name, set()).add(dim)
    state = _compat.call_state()

    def read(
        facts: list[_compat.GuardFact],
        symbols: dict[str, tuple[str | None, ...]],
        writes: bool,
        not_at_one: frozenset[str],
    ) -> call_check.CallSpec:
        symbolic = {name: tuple(s is not None for s in dims) for name, dims in symbols.items()}
        translation = dynamo_guards.translate(
            facts, symbolic, lambda n: dynamo_guards.readable(n, names), symbols
        )
        floors = (
            size_floors(symbols, not_at_one, lambda n: dynamo_guards.readable(n, names)) if oblivious else ()
        )
        spec = call_check.record(
            args,
            kwargs,
            lambda path: names.get(path, path),
            # Marked dims, and every dim the trace made symbolic (a tensor nested in a dict
            # argument, a mask per attention type): Dynamo's guards bound those, not a size.
            lambda path: (
                frozenset(dynamic.get(names.get(path, ""), ()))
                | frozenset(d for d, s in enumerate(symbols.get(path, ())) if s is not None)
            ),
            (*translation.assumptions, *floors),
            translation.parents,
            state,
            writes,
        )
        bound = spec.bind(model.target, _compat.guard_globals(model.traced_fn.__globals__))
        broken_now = {a.expr for a, _ in spec.mismatches(args, kwargs, bound)}
        at_one = [a.label for a in floors if a.expr in broken_now]
        if at_one:
            raise TracedAtOne(f"the graph treats a size of this call apart ({at_one[0]})")
        if hinted and broken_now:
            raise TracedAtOne(
                f"a trace with a general size hint does not hold for this call ({sorted(broken_now)[0]})"
            )
        # An assumption the very call it came from breaks is a translation tessera cannot
        # check: say so (it would refuse every call), and keep the rest.
        broken = broken_now
        if broken:
            log.warning("%s: guards tessera cannot re-check, not checked: %s", model.name, sorted(broken))
            kept = tuple(a for a in spec.assumptions if a.expr not in broken)
            spec = dataclasses.replace(spec, assumptions=kept)
        dropped(translation.dropped)
        return spec

    return read
