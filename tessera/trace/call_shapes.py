"""The calls that differ from a trace only in syntax, routed by their shape.

A call's shape is its positional count and keyword names, in order: cheap to read, and all that
decides how it is rewritten in a trace's structure (``call_args.rewrite``: a flag passed by
keyword to a trace made with it positional, an argument left to its default that the trace saw
passed). The rewrite is worked out once per shape and entry, when the slow path first serves such
a call; later calls of that shape are rewritten and given the entry's own generated check
(``accepts``), and a call the check refuses goes the slow way, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

from tessera.trace import call_args, call_check

Shape = tuple[int, tuple[str, ...]]

# Shapes remembered at most (the oldest forgotten first): a model is called in a few syntaxes.
SHAPE_LIMIT = 32


class Checked(Protocol):
    """What a route leads to: an entry with its generated check (trace_entry.TraceEntry)."""

    @property
    def accepts(self) -> Callable[[tuple[Any, ...], dict[str, Any]], bool]: ...


E = TypeVar("E", bound=Checked)


@dataclass(frozen=True)
class Routed(Generic[E]):
    """The entry that serves a call, and the call as it runs there (rewritten for its trace)."""

    entry: E
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def shape_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Shape:
    return len(args), tuple(kwargs)


@dataclass(frozen=True)
class ShapeRoute(Generic[E]):
    """An entry that served a call of one shape, and the rewrite of that shape into its structure."""

    entry: E
    rewrite: call_args.Rewrite


class ShapeRoutes(Generic[E]):
    """Owns, for each call shape that needed rewriting, the entries that served it and each one's
    rewrite: at most ``limit`` shapes. Read without a lock from any thread: a change swaps in a new
    dict (two threads remembering at once may lose one route, which the next such call makes again)."""

    def __init__(self, limit: int = SHAPE_LIMIT) -> None:
        self.limit = limit
        self._routes: dict[Shape, tuple[ShapeRoute[E], ...]] = {}

    def find(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Routed[E] | None:
        """The entry that serves this call, and the call rewritten for it; None when no entry
        remembered for its shape passes its check on the rewritten call."""
        for route in self._routes.get(shape_of(args, kwargs), ()):
            try:
                n_args, n_kwargs = route.rewrite.apply(args, kwargs)
            except call_check.InputMismatchError:
                continue  # passes an argument with another value than the default the trace saw
            if route.entry.accepts(n_args, n_kwargs):
                return Routed(route.entry, n_args, n_kwargs)
        return None

    def remember(self, shape: Shape, entry: E, rewrite: call_args.Rewrite) -> None:
        """Route calls of ``shape`` to ``entry`` through ``rewrite`` from now on."""
        known = self._routes.get(shape, ())
        if any(route.entry is entry for route in known):
            return
        routes = dict(self._routes)
        routes.pop(shape, None)
        while routes and len(routes) >= self.limit:
            del routes[next(iter(routes))]
        routes[shape] = (*known, ShapeRoute(entry, rewrite))
        self._routes = routes

    def __len__(self) -> int:
        return len(self._routes)


# Calls remembered as uncovered at most, while a trace is in flight (a stream has a few sizes).
UNCOVERED_LIMIT = 64
_SCALARS = (int, float, bool, str, type(None))


def call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a call looks like at its top level: each tensor's dtype, device, size and strides,
    each scalar's value, each other argument's type. Two calls with one key may still differ
    below it (a dict's tensors, a cache object's): ``UncoveredCalls`` only ever errs towards eager."""
    return (len(args), tuple(kwargs), tuple(_value_key(v) for v in (*args, *kwargs.values())))


def _value_key(value: Any) -> object:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.shape, value.stride(), value.requires_grad)
    if isinstance(value, _SCALARS):
        return (type(value), value)
    return type(value)


class UncoveredCalls(Generic[E]):
    """The calls no entry covered, while a trace is in flight: a later call that looks the same
    (``call_key``) is served eagerly beside the trace without the search through every entry's
    assumptions first (trace_route.covering: an eighth of a tiny BERT's eager call, so that a call
    slow for other reasons went past 2x eager's). Valid for one set of entries: any change (a trace
    landed) forgets them all.

    A call wrongly taken for uncovered (one that differs from a remembered one below the key) is
    served eagerly, as a call no entry covers is: eager's output, a little slower than its
    entry's, and only until the trace lands; no call is taken for covered. Read without a lock
    from any thread: a change swaps in a new record."""

    def __init__(self, limit: int = UNCOVERED_LIMIT) -> None:
        self.limit = limit
        self._record: tuple[tuple[E, ...], frozenset[tuple[Any, ...]]] = ((), frozenset())

    def known(self, entries: tuple[E, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a call like this one was found uncovered by these very entries."""
        seen, keys = self._record
        return seen is entries and bool(keys) and call_key(args, kwargs) in keys

    def add(self, entries: tuple[E, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Remember that no one of ``entries`` covers this call."""
        seen, keys = self._record
        if seen is not entries:
            keys = frozenset()
        if len(keys) < self.limit:
            self._record = (entries, keys | {call_key(args, kwargs)})
