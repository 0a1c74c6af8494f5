"""The records of a model's traces: what every trace is made from (``Model``, ``TraceContext``)
and one trace (``TraceEntry``)."""

from __future__ import annotations

import functools
import inspect
import logging
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera import _compat
from tessera.cache.remote import RemoteTier
from tessera.errors import first_line
from tessera.serving.split_model import SplitModel
from tessera.trace import call_check

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceContext:
    """What every trace of this model needs, found at the first call: compiler, cache root and
    prefix, the model's fingerprint (None: no whole-model artifact) and the remote tier."""

    compiler: Any
    root: Path | None
    prefix: str
    fingerprint: str | None
    remote: RemoteTier | None
    # The fleet's pointer is still to fetch (``open(defer_fetch=True)``): the first call is served
    # eagerly meanwhile, and the trace made beside it fetches the pointer first (traces.py).
    fetch_deferred: bool = False

    @classmethod
    def open(
        cls,
        config: Any,
        func: types.FunctionType,
        bound_to: object | None,
        dynamic_dims: Any,
        prefix: str | None,
        phases: dict[str, float],
        defer_fetch: bool = False,
    ) -> TraceContext:
        """The context of a model's traces: its compiler, cache places and fingerprint (timed in
        ``phases``), and the remote tier's pointer to its saved traces, fetched; ``defer_fetch``:
        left to ``fetch_fleet`` (a request to the store is not made before eager's first output)."""
        from tessera.cache.entry import rank_dir
        from tessera.cache.fleet import cache_places, fetch_pointer
        from tessera.cache.key import fingerprint_record
        from tessera.cache.pointer import pointer_path
        from tessera.compilation.compile_state import between_compiles
        from tessera.compilation.compilers import make_compiler, warm_hash

        compiler = make_compiler(config.backend)
        places = cache_places(config)
        root, remote = places.root, places.remote
        prefix = prefix or "model"
        print_ = None
        deferred = False
        if root is not None:
            start = time.perf_counter()
            with between_compiles():  # another model's compile must not lend us its config patches
                print_ = fingerprint_record(
                    func, bound_to, dynamic_dims, config, warm_hash(compiler), prefix, rank_dir()
                ).digest
            phases["fingerprint"] = time.perf_counter() - start
            if remote is not None and defer_fetch:
                deferred = not pointer_path(root, print_).exists()
            elif remote is not None:
                try:
                    fetch_pointer(remote, root, print_)
                except Exception as e:  # the fleet is a cache: never a reason not to serve
                    log.warning(
                        "%s: the fleet's traces were not fetched (%s); tracing the call",
                        prefix,
                        first_line(e),
                        exc_info=log.isEnabledFor(logging.DEBUG),
                    )
        return cls(compiler, root, prefix, print_, remote, deferred)

    def fetch_fleet(self) -> bool:
        """The fleet's pointer and the entry it names, into the local cache (``open`` deferred it);
        whether they were fetched."""
        from tessera.cache.fleet import fetch_pointer

        if self.fetch_deferred and self.remote is not None and self.root is not None and self.fingerprint:
            return fetch_pointer(self.remote, self.root, self.fingerprint)
        return False


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
    split_model: SplitModel
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


def top_level_tensors(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[tuple[str, str], torch.Tensor]]:
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            yield ("args", str(i)), value
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            yield ("kwargs", key), value


def versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[tuple[str, str], int]:
    """The version counter of each top-level tensor argument (in-place writes bump it)."""
    return {path: _compat.version_counter(tensor) for path, tensor in top_level_tensors(args, kwargs)}


def changed_arguments(
    before: dict[tuple[str, str], int], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> frozenset[tuple[str, str]]:
    """The arguments whose version moved since ``before``: the ones the model writes to."""
    return frozenset(
        path
        for path, tensor in top_level_tensors(args, kwargs)
        if before.get(path, -1) != _compat.version_counter(tensor)
    )


def make_entry(
    model: Model,
    context: TraceContext,
    number: int,
    spec: call_check.CallSpec,
    fast: Callable[..., Any],
    split_model: SplitModel,
    reason: str,
    *,
    loaded: bool,
    code: types.CodeType | None = None,
    mutated: frozenset[tuple[str, str]] = frozenset(),
    timed: tuple[float, float] = (0.0, 0.0),
) -> TraceEntry:
    """Trace ``number`` of ``model``: its check bound to the model, and the sizes its pieces learn
    recorded for the next process."""
    from tessera.trace import warm

    bound = spec.bind(model.target, _compat.guard_globals(model.traced_fn.__globals__))
    learning = split_model.learning
    if context.root is not None and context.fingerprint is not None and learning.learnt_sink is None:
        learning.learnt_sink = functools.partial(
            warm.save_sizes, context.root, context.fingerprint, context.remote
        )
    return TraceEntry(
        number=number,
        reason=reason,
        spec=spec,
        fast=fast,
        accepts=call_check.make_predicate(spec, bound),
        bound=bound,
        tensors=call_check.tensor_reader(spec, bound),
        split_model=split_model,
        loaded=loaded,
        code=code,
        mutated=mutated,
        started=timed[0],
        seconds=timed[1],
    )
