"""The records of a model's traces: what every trace is made from (``Model``, ``TraceContext``)
and one trace (``TraceEntry``)."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera import call_check
from tessera.backend import PiecewiseBackend
from tessera.cache.remote import RemoteTier


@dataclass(frozen=True)
class TraceContext:
    """What every trace of this model needs, found at the first call: compiler, cache root and
    prefix, the model's fingerprint (None: no whole-model artifact) and the remote tier."""

    compiler: Any
    root: Path | None
    prefix: str
    fingerprint: str | None
    remote: RemoteTier | None


@dataclass(frozen=True)
class TraceEntry:
    """One trace of the model: what it assumed of a call and what runs a call that holds it."""

    number: int
    reason: str  # why it was made: "the first call", or the assumption the nearest entry broke
    spec: call_check.CallSpec
    fast: Callable[..., Any]  # the compiled forward, unchecked
    accepts: Callable[[tuple[Any, ...], dict[str, Any]], bool]  # the check alone
    bound: dict[str, Any]  # what the check reads besides the arguments
    tensors: Callable[..., tuple[Any, ...]]  # the tensors the trace read (for the grad policy)
    backend: PiecewiseBackend
    loaded: bool  # from the whole-model artifact (no trace in this process)
    code: types.CodeType | None = None  # Dynamo's transformed code (None when loaded)
    mutated: frozenset[tuple[str, str]] = frozenset()  # top-level arguments the model writes to
    started: float = 0.0  # when its trace started (wall-clock seconds; 0.0 when loaded)
    seconds: float = 0.0  # what the trace took, its compiles left out


@dataclass(frozen=True)
class Model:
    """What every trace of one model is made from, fixed at ``tessera.compile``."""

    name: str
    func: types.FunctionType
    bound_to: object | None
    target: Callable[..., Any]  # what the traced frame calls: the forward
    traced_fn: types.FunctionType  # the frame tessera traces (wrapper.entry_frame)
    signature: inspect.Signature
    owner: Any  # the module whose parameters name a tensor needing grad (or None)
