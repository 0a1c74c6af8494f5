"""What a trace assumed of a call: one ``Assumption`` per fact, its ``Kind``, and a ``Mismatch``
when a call breaks one. Records only; the check that compares them is call_check.py."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple


class Kind(enum.Enum):
    """What an assumption is about: what a call that breaks it may be served by."""

    TYPE = "type"
    DTYPE = "dtype"
    DEVICE = "device"
    RANK = "number of dims"
    SHAPE = "shape"  # a tensor's whole shape (parameters, inputs without a dynamic dim)
    SIZE = "size"  # one static dim of an input tensor (``dim``)
    LAYOUT = "layout"  # an input tensor's strides or their order: copied into it when they differ
    VALUE = "value"
    STATE = "state"  # Python state read from an argument (a StaticCache length), sizes' relations
    FLOOR = "floor"  # ``size >= 2`` on a dynamic dim (``dim``): smaller sizes get their own trace
    OTHER = "other"  # identity, length, keys, attributes present: a trace of its own


@dataclass(frozen=True)
class Assumption:
    """One thing the trace depended on: ``expr`` (over ``args``/``kwargs``) evaluates to ``expected``."""

    expr: str
    expected: Any
    label: str  # e.g. "input_ids: dtype", for people
    kind: Kind = Kind.OTHER
    path: str = ""  # the value it reads (``args[0]``, ``kwargs['cache'][1]``), when it reads one
    dim: int | None = None  # the dim of ``path`` a SIZE or FLOOR assumption is about


class Mismatch(NamedTuple):
    """An assumption a call breaks, and the value the call has there."""

    assumption: Assumption
    found: Any
