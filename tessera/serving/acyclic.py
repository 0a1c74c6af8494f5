"""No reference cycles through what a service drops.

A compiled model hands its own methods to the parts it owns (the traces call back to install an
entry), and generated functions live in namespaces of their own. A bound method held by what the
model owns, or a function left in its own globals, is a reference cycle, and a cycle is freed only
by CPython's cyclic collector, which never walks a heap frozen after the background work (heap.py):
a model a service drops would stay, with its weights. So callbacks hold their object weakly, and a
generated function is taken out of the namespace it was defined in: the model goes with its last
reference, by reference counting alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import CodeType
from typing import Any


def weakly(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` (a bound method), called while its object lives; a no-op returning None after."""
    ref = weakref.WeakMethod(method)  # type: ignore[arg-type]

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


def define(source: str | CodeType, filename: str, namespace: dict[str, Any], name: str) -> Callable[..., Any]:
    """The function ``name`` that our own generated ``source`` (or its code) defines, executed in
    ``namespace`` and taken out of it: its globals are that namespace, and left there it would hold
    itself."""
    exec(compile(source, filename, "exec") if isinstance(source, str) else source, namespace)
    function: Callable[..., Any] = namespace.pop(name)
    return function
