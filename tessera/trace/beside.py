"""Eager first: a call no trace covers is served eagerly, and traced beside it.

With background compile on, the first call of a cold process (and later, each call no trace
covers) is answered by the model's own forward on the calling thread; a copy of the call is
traced in a thread of its own, after eager answered (the two never compete for the GIL on that
call). The trace ends before its frame would run (``wrapper.trace_once(run=False)``): the model's
state, a Hugging Face cache, the RNG are written once, by eager. It traces what the call saw: its
arguments are copied before eager runs, so later calls changing them change nothing here. Once the
trace serves, its check applies to every call, and its pieces compile beside it (schedule.py).

Calls that arrive while a trace is being made are served eagerly too (a call eager rejects raises
eager's error and is not kept). A model whose trace fails keeps serving eagerly: said once, with
the reason.

Not the default (``CompileConfig.eager_first``): the trace thread shares the process with the
user's code. Dynamo saves the global RNG state as a trace starts and sets it back as it ends, in the
trace's thread, so draws the user's code makes meanwhile are undone and repeat; and the trace
imports Dynamo and Inductor while the user's code may import them too (docs/process.md).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tessera import _compat, counters
from tessera.compilation.compile_state import COMPILE_LOCK
from tessera.errors import first_line
from tessera.trace.assumption import Mismatch

log = logging.getLogger(__name__)

# trace(args, kwargs, reason, mismatches): a trace of the call that does not run it (traces.py).
Tracer = Callable[[tuple[Any, ...], dict[str, Any], str, list[Mismatch]], Any]
Call = tuple[tuple[Any, ...], dict[str, Any]]  # a call's arguments, as copied
Job = tuple[Call, str, list[Mismatch], "CallerState"]  # a call to trace, why, in what state
MISSED = 32  # calls kept while a trace is in flight, at most
MISSED_BYTES = 64 * 2**20  # and the tensor bytes their copies may hold, in all


def eager_first(config: Any) -> bool:
    """Whether a call no trace covers is served eagerly and traced beside it: asked for
    (``eager_first``), with background compile on, for the traced modes, unless the user asked for
    the refusal of graph breaks at the first call (``fullgraph``) or of calls past a trace limit
    (``max_traces`` given: which calls are refused must not depend on when a trace lands), or set
    torch.compile's stance (``torch.compiler.set_stance``)."""
    return bool(
        config.eager_first
        and config.background_compile
        and not config.strict_traces
        and config.mode in ("trace_once", "piecewise")
        and _compat.default_stance()
    )


@dataclasses.dataclass(frozen=True)
class CallerState:
    """The calling thread's state a trace depends on, to make it again in another thread: grad
    mode, inference mode and autocast are per thread (the default dtype is per process)."""

    grad: bool
    inference: bool
    autocast: tuple[tuple[str, torch.dtype], ...]

    @classmethod
    def current(cls) -> CallerState | None:
        """This thread's state; None under a torch-function mode (``with torch.device(...)``),
        which another thread cannot enter as the caller did: such a call is traced where it is."""
        autocast, _, modes = _compat.call_state()
        if modes:
            return None
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            yield


class Beside:
    """Eager serving and the one trace in flight beside it, for one model."""

    def __init__(
        self,
        name: str,
        forward: Callable[..., Any],
        trace: Tracer,
    ) -> None:
        self.name = name
        self._forward = forward
        self.tracer = trace  # what traces each call (replaceable: api.py's cold first call)
        self._lock = threading.Lock()
        self._pending = False
        self.landed = threading.Event()  # set while no trace is in flight
        self.landed.set()
        self.failure: BaseException | None = None  # the trace that failed: eager from then on
        self.on_failure: Callable[[BaseException], None] | None = None
        self.eager_calls = 0
        self.eager_span = (0.0, 0.0)  # wall clock: the first eager call's start, the last one's end
        # The compiled model, weakly (acyclic.py): held by the trace thread while it runs, so that
        # a model dropped meanwhile (a function's local) still leaves its traces in the cache.
        self.owner: Callable[[], Any] = lambda: None
        self._missed: list[tuple[Call, CallerState]] = []  # calls kept while a trace is in flight
        self._kept = 0  # the tensor bytes of their copies
        # uncovered(call): why no trace covers it, (reason, mismatches), or None (traces.py).
        self.uncovered: Callable[[Call], tuple[str, list[Mismatch]] | None] | None = None

    def busy(self) -> bool:
        """Whether a call no trace covers is served eagerly with no trace started for it: one is in
        flight, or the model's trace failed."""
        return self._pending or self.failure is not None

    def eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call served by the model's own forward."""
        self.eager_calls += 1
        counters.bump("served_eagerly")
        start = time.time()
        try:
            return self._forward(*args, **kwargs)
        finally:
            self.eager_span = (self.eager_span[0] or start, time.time())

    def missed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call no trace covers while one is in flight: served eagerly, and kept (a copy, as it
        was) among the first few such calls, each traced after the one in flight if no trace made
        by then covers it, as it would have been traced had it come alone (a process that stops
        meanwhile still leaves every trace its calls needed in the cache)."""
        room = self.failure is None and len(self._missed) < MISSED
        size = tensor_bytes((args, kwargs)) if room else 0
        seen: Call | None = None
        state = CallerState.current() if room and self._kept + size <= MISSED_BYTES else None
        if state is not None:
            seen = _copied(self.name, args, kwargs)  # as the call saw it, before eager runs
        output = self.eager(args, kwargs)  # a call eager rejects raises here, and is not kept
        if seen is not None and state is not None:
            with self._lock:
                if self._pending and len(self._missed) < MISSED:
                    self._missed.append((seen, state))
                    self._kept += size
        return output

    def serve(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: str, mismatches: list[Mismatch]
    ) -> tuple[Any] | None:
        """``(eager's output,)``, this call traced beside it when no trace is in flight; None when
        the call cannot be traced elsewhere (the caller traces it, as without eager first)."""
        state = CallerState.current()
        if state is None:
            return None
        with self._lock:
            start = not self.busy()
            if start:
                self._pending = True
                self.landed.clear()
        if not start:
            return (self.missed(args, kwargs),)
        seen = _copied(self.name, args, kwargs)  # what the call saw, before eager changes it
        if seen is None:  # an argument that cannot be copied: traced on this thread
            self._start(None)
            return None
        try:
            output = self.eager(args, kwargs)
        except BaseException:
            self._start(None)  # eager's error is the caller's: no trace of a call eager rejects
            raise
        self._start((seen, reason, mismatches, state))
        return (output,)

    def _start(self, job: Job | None) -> None:
        """Trace ``job`` (None: only the calls kept meanwhile, if any) in a thread of its own."""
        if job is None:
            with self._lock:
                if not self._missed:
                    self._pending = False
                    self.landed.set()
                    return
        from tessera.compilation.background import start_thread  # off `import tessera`

        name, owner = f"tessera-trace-{self.name}", self.owner()
        finish = owner is not None and owner.compile_config.finish_at_exit
        if (
            start_thread(name, self._run, job, owner, finish_at_exit=finish) is None
        ):  # the process exits: nothing traced
            with self._lock:
                self._missed.clear()
                self._pending = False
                self.landed.set()

    def _run(self, job: Job | None, owner: Any) -> None:  # owner: held while the thread runs
        # The compiles the traces start wait until the last call kept meanwhile is traced: each
        # trace lets calls of its shape leave eager serving; a compile only speeds up a trace that
        # the next one may widen and hold back (compile_state.py).
        with COMPILE_LOCK.traces_coming():
            if job is None:
                job = self._next()
            while job is not None:
                self._trace_one(*job)
                job = self._next()

    def _trace_one(self, seen: Call, reason: str, mismatches: list[Mismatch], state: CallerState) -> None:
        try:
            with state.applied():
                self.tracer(seen[0], seen[1], reason, mismatches)
        except Exception as e:
            self.failure = e
            log.debug("%s: the trace beside eager failed (%s)", self.name, first_line(e), exc_info=True)
            if self.on_failure is not None:
                self.on_failure(e)

    def _next(self) -> Job | None:
        """The next call kept while a trace was in flight that no trace covers now; None (and no
        trace in flight from then on) when none is left."""
        while True:
            with self._lock:
                if not self._missed or self.failure is not None:
                    self._missed.clear()
                    self._kept = 0
                    self._pending = False
                    self.landed.set()
                    return None
                seen, state = self._missed.pop(0)
            why = self.uncovered(seen) if self.uncovered is not None else None
            if why is not None:
                return (seen, why[0], why[1], state)


def tensor_bytes(obj: Any, depth: int = 0) -> int:
    """The bytes of the tensors ``obj`` holds: in containers and plain objects' attributes (a Hugging
    Face cache's layers), a few levels deep; a module's parameters are the model's, not the call's."""
    if isinstance(obj, torch.Tensor):
        return obj.nelement() * obj.element_size()
    if depth > 5 or isinstance(obj, (torch.nn.Module, str, bytes, int, float, bool, type(None))):
        return 0
    if isinstance(obj, dict):
        items: Any = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = obj
    else:
        items = getattr(obj, "__dict__", {}).values()
    return sum(tensor_bytes(item, depth + 1) for item in items)


def _copied(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call | None:
    """A copy of the call's arguments (tensors, caches, containers), or None when one cannot be."""
    try:
        return copy.deepcopy((args, kwargs))
    except Exception as e:
        log.info("%s: the call cannot be copied to trace beside eager (%s)", name, first_line(e))
        return None
