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

from tessera import call_args, call_check

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
