"""How a model's next trace marks what may change between calls (``TracePlan``), widened by every
trace made again, as Dynamo's automatic dynamic shapes: a size or argument int that changed
against any trace is dynamic from then on; a size the code treats apart (0 or 1) is static only for
calls of that size. Saved beside the model's traces for the next process (``plan_to_json``).
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tessera import _compat, validation
from tessera.trace import call_check, dynamo_guards
from tessera.trace.assumption import Assumption, Kind, Mismatch
from tessera.trace.wrapper import DynamicChoice, choose_dynamic_dims, mark_dynamic


@dataclass(frozen=True)
class TracePlan:
    """How the next trace marks what may change between calls, widened by every re-trace."""

    dims: tuple[tuple[str, int], ...] = ()  # top-level argument dims made dynamic by a re-trace
    nested: tuple[tuple[str, int], ...] = ()  # dims of tensors inside arguments (path, dim)
    state: tuple[str, ...] = ()  # Python ints of argument objects traced as symbols
    # Dims (argument name or nested path, dim) whose sizes 0 and 1 the code treats apart: a call
    # with such a size there is traced with it static, and the dim stays dynamic for every other
    # call (Dynamo specialises a size of 0 or 1 the same way, graph by graph).
    apart: frozenset[tuple[str, int]] = frozenset()
    seen: frozenset[str] = frozenset()  # the tensor arguments some trace was made with
    soft: bool = False  # marks are "maybe dynamic": Dynamo keeps a dim static where the code fixes it


def plan_to_json(plan: TracePlan) -> dict[str, list[Any]]:
    """A plan as JSON lists (saved beside the fingerprint's traces, cache/pointer.write_plan)."""
    return {
        "dims": [list(d) for d in plan.dims],
        "nested": [list(d) for d in plan.nested],
        "state": list(plan.state),
        "apart": sorted(list(d) for d in plan.apart),
        "seen": sorted(plan.seen),
    }


def plan_from_json(data: dict[str, list[Any]]) -> TracePlan:
    """``plan_to_json``'s inverse; what is not well formed is left out (it only widens)."""

    def pairs(key: str) -> tuple[tuple[str, int], ...]:
        return tuple(
            (str(p[0]), int(p[1]))
            for p in data.get(key, [])
            if isinstance(p, list) and len(p) == 2 and isinstance(p[1], int) and not isinstance(p[1], bool)
        )

    return TracePlan(
        dims=pairs("dims"),
        nested=pairs("nested"),
        state=tuple(str(x) for x in data.get("state", []) if isinstance(x, str)),
        apart=frozenset(pairs("apart")),
        seen=frozenset(str(x) for x in data.get("seen", []) if isinstance(x, str)),
    )


def merged_plans(a: TracePlan, b: TracePlan) -> TracePlan:
    """What either plan made dynamic (this process's and what earlier processes saved)."""

    def union(x: tuple[Any, ...], y: tuple[Any, ...]) -> tuple[Any, ...]:
        return (*x, *(i for i in y if i not in x))

    return TracePlan(
        dims=union(a.dims, b.dims),
        nested=union(a.nested, b.nested),
        state=union(a.state, b.state),
        apart=a.apart | b.apart,
        seen=a.seen | b.seen,
        soft=a.soft or b.soft,
    )


def widened(plan: TracePlan, names: dict[str, str], mismatches: list[Mismatch]) -> TracePlan:
    """``plan`` with what changed between the nearest entry's trace and this call made
        dynamic (sizes, argument ints), as Dynamo's automatic dynamic shapes; a size the nearest
        entry bounded from below that this call goes under is traced static when it is that small
        (its own entry), and stays dynamic for every other size. ``names``: each argument
    path's name (call_args.argument_names)."""
    dims, nested, state = list(plan.dims), list(plan.nested), list(plan.state)
    apart = set(plan.apart)
    for assumption, found in mismatches:
        if assumption.kind is Kind.FLOOR and assumption.dim is not None:
            path, dim = assumption.path, assumption.dim
            apart.add((names[path], dim) if path in names else (path, dim))
            continue
        if (
            assumption.kind is Kind.STATE
            and validation.is_int(assumption.expected)
            and validation.is_int(found)
        ):
            if _compat.supports_dynamic_state() and assumption.expr not in state:
                state.append(assumption.expr)
            continue
        for path, dim in changed_dims(assumption, found):
            if path in names:
                if (names[path], dim) not in dims:
                    dims.append((names[path], dim))
            elif (path, dim) not in nested:
                nested.append((path, dim))
    return dataclasses.replace(
        plan, dims=tuple(dims), nested=tuple(nested), state=tuple(state), apart=frozenset(apart)
    )


def newcomer_dims(plan: TracePlan, values: dict[str, Any], traced: bool) -> list[tuple[str, int]]:
    """Dims of a tensor argument no earlier trace had (a mask a later call passes) whose size
    is that of a dim found changing: marked "maybe dynamic" at once. Dynamo would trace the
    newcomer static and make it dynamic a trace later; a static mask fixed the prompt's
    length through the model's equality of the two, so each length was a trace of its own."""
    if not traced or not plan.dims:
        return []
    sizes = {
        values[n].shape[d]
        for n, d in plan.dims
        if isinstance(values.get(n), torch.Tensor) and d < values[n].dim() and values[n].shape[d] >= 2
    }
    out: list[tuple[str, int]] = []
    for name, value in values.items():
        if name in plan.seen or not isinstance(value, torch.Tensor):
            continue
        out.extend((name, d) for d, size in enumerate(value.shape) if size in sizes)
    return out


def small_apart(plan: TracePlan, name: str, dim: int, value: Any) -> bool:
    """Whether this call's size of ``name``'s ``dim`` is one the code treats apart (0 or 1,
    where an earlier trace's floor broke): traced static, for this trace only."""
    return (
        (name, dim) in plan.apart
        and isinstance(value, torch.Tensor)
        and dim < value.dim()
        and value.shape[dim] < 2
    )


def nested_tensors(
    plan: TracePlan, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[torch.Tensor, int]]:
    """The tensors inside arguments whose dims the plan makes dynamic, with each dim."""
    for path, dim in plan.nested:
        try:
            value = call_check.read_path(path, args, kwargs)
        except Exception:
            continue
        if isinstance(value, torch.Tensor) and dim < value.dim() and not small_apart(plan, path, dim, value):
            yield value, dim


# The size hint a dynamic size of 0 or 1 is traced with (see traces.Traces._trace_with).
GENERAL_HINT = 8


def small_dims(values: dict[str, Any], choice: DynamicChoice) -> list[tuple[torch.Tensor, int]]:
    """The dims marked dynamic whose size in this call is 0 or 1 (traced with a general hint)."""
    out = []
    for name, dim in choice.dims:
        value = values.get(name)
        if isinstance(value, torch.Tensor) and dim < value.dim() and value.shape[dim] < 2:
            out.append((value, dim))
    return out


def hinted(values: dict[str, Any], choice: DynamicChoice) -> bool:
    return bool(small_dims(values, choice))


def changed_dims(assumption: Assumption, found: Any) -> list[tuple[str, int]]:
    """The (path, dim) of each static size of an argument's tensor this call changed."""
    path = assumption.path
    if assumption.kind not in (Kind.SIZE, Kind.SHAPE) or not path.startswith(("args[", "kwargs[")):
        return []  # not a size, or one of the model's own tensors
    if assumption.kind is Kind.SIZE:
        return [(path, assumption.dim)] if validation.is_int(found) and assumption.dim is not None else []
    expected = assumption.expected
    if not isinstance(found, torch.Size) or len(found) != len(expected):
        return []  # another rank: a trace of its own, nothing made dynamic
    return [(path, d) for d, (f, e) in enumerate(zip(found, expected, strict=True)) if f != e]


def size_floors(
    symbols: dict[str, tuple[str | None, ...]], not_at_one: frozenset[str], label: Callable[[str], str]
) -> tuple[Assumption, ...]:
    """A size-oblivious trace serves a dynamic size down to 1 (size 0 gets its own trace), and
    down to 2 where an op of the graph treats 1 apart (``wrapper.size_one_symbols``)."""
    out = []
    seen: set[str] = set()
    for name, dims in symbols.items():
        if dynamo_guards.root_of(name) != "input":
            continue
        for d, symbol in enumerate(dims):
            if symbol is None or symbol in seen or not re.fullmatch(r"s\d+", symbol):
                continue
            seen.add(symbol)
            low = 2 if symbol in not_at_one else 1
            why = "an op of the graph treats size 1 apart" if low == 2 else "size 0 is traced apart"
            out.append(
                Assumption(
                    f"{name}.shape[{d}] >= {low}",
                    True,
                    f"sizes: {label(name)} dim {d} >= {low} ({why})",
                    Kind.FLOOR,
                    name,
                    d,
                )
            )
    return tuple(out)


def dims_for(
    plan: TracePlan,
    func: types.FunctionType,
    values: dict[str, Any],
    wanted: Mapping[str, int | tuple[int, ...]] | None,
    soft: bool,
) -> DynamicChoice:
    """The dims marked dynamic for a trace of this call: the user's (``wanted``, or the guess),
    and those earlier traces found changing; minus those held static. ``soft``: suggested dims
    (tessera.hf), marked "maybe dynamic"."""
    if soft and wanted is not None:
        # Suggested dims: an argument that is not a tensor in this call (a mask passed as a dict
        # of masks) has none.
        wanted = {n: d for n, d in wanted.items() if isinstance(values.get(n), torch.Tensor)}
    choice = choose_dynamic_dims(func, values, wanted)
    extra = [
        (n, d)
        for n, d in plan.dims
        if isinstance(values.get(n), torch.Tensor) and d < values[n].dim() and (n, d) not in choice.dims
    ]
    dims = tuple(d for d in (*choice.dims, *extra) if not small_apart(plan, d[0], d[1], values.get(d[0])))
    return DynamicChoice(dims, choice.guessed or soft or plan.soft or bool(extra))


def mark_call(
    plan: TracePlan,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    values: dict[str, Any],
    choice: DynamicChoice,
    mode: str,
    mark_nested: Callable[[dict[str, Any]], None] | None,
    oblivious: bool,
) -> bool:
    """Mark this call's tensors for its trace: the chosen dims (``mode``), the nested dims the plan
    makes dynamic ("maybe dynamic"), and a preset's own marks (``mark_nested``). Whether a dynamic
    size of 0 or 1 was given a general hint (size-oblivious traces only)."""
    mark_dynamic(values, choice, mode)
    if mark_nested is not None:
        mark_nested(values)
    dynamo = _compat.dynamo()
    for tensor, dim in nested_tensors(plan, args, kwargs):
        dynamo.maybe_mark_dynamic(tensor, dim)
    small = 0
    if oblivious:
        # A dynamic size of 0 or 1 traced with a general hint: Inductor reads the hint as the size
        # where it decides (a kernel for one row served two wrongly). The trace is kept only if
        # this call holds every guard it made (trace_check.recorder).
        for value, dim in small_dims(values, choice):
            _compat.override_size_hint(value, dim, GENERAL_HINT)
            small += 1
    return small > 0
