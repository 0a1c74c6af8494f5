"""What a compile runs under: the traced call's state, in whichever thread or process compiles,
and the one lock every compile of the process holds (``COMPILE_LOCK``).

Grad mode and autocast are thread-local: a background thread starts with grad enabled and no
autocast, so a piece compiled there without this record would be compiled for autograd (saving
tensors for backward: slower, and unusable under ``inference_mode``) or without the call's autocast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from types import TracebackType

import torch

from tessera import _compat
from tessera._compat import AUTOCAST_DEVICES

log = logging.getLogger(__name__)


class _CompileLock:
    """Held by every compile of this process (a trace, a background compile, a worker's result).

    It is Dynamo's own compile lock: Inductor and Dynamo keep process-wide state (config patches,
    the cache-artifact recorder a standalone compile saves from, tracing contexts), so a compile of
    ours must not overlap any other compile in the process: the user's ``torch.compile``, another
    tessera model's trace. Dynamo holds this lock while it traces a frame and calls the backend,
    so taking it (and not a lock of our own beside it) also keeps one lock order: a lock of ours
    taken first in a background thread and Dynamo's taken first by a trace deadlocked.
    """

    def __init__(self) -> None:
        self._traces = 0  # traces waiting for the lock (``for_trace``) or queued (``traces_coming``)
        self._ahead = 0  # background compiles of the traces that serve, with jobs left (``ahead``)
        self._no_trace_waits = threading.Condition()

    @contextlib.contextmanager
    def traces_coming(self) -> Iterator[None]:
        """Background compiles wait (``after_traces``) while this runs: a thread that makes
        traces one after another (beside.py: the calls kept while one was made) keeps its place
        between them. Counted only while it waited for the lock, the first trace's background
        compile took the lock as that trace let it go, before the next trace asked: BERT's calls
        of a second length were served eagerly for the whole of its first Inductor compile, and that
        trace's compiles, once the next trace widened it, were thrown away."""
        with self._no_trace_waits:
            self._traces += 1
            self._no_trace_waits.notify_all()
        try:
            yield
        finally:
            with self._no_trace_waits:
                self._traces -= 1
                self._no_trace_waits.notify_all()

    @contextlib.contextmanager
    def for_trace(self) -> Iterator[None]:
        """The lock, for a trace: taken before the next background compile that asks for it
        (``after_traces``). A trace is what lets calls of a new shape leave eager serving, and
        each compile of a general or specialized artifact only makes a covered call faster: a
        trace that waited behind a model's whole background compile (Python's locks are not
        fair: a thread that releases and takes again keeps it) left BERT's calls of a new length
        served eagerly for the whole compile."""
        with self._no_trace_waits:
            self._traces += 1
            self._no_trace_waits.notify_all()  # a count others may wait on (the tests do)
        try:
            self.__enter__()
        finally:
            with self._no_trace_waits:
                self._traces -= 1
                self._no_trace_waits.notify_all()
        try:
            yield
        finally:
            self.__exit__(None, None, None)

    def after_traces(self, behind: Callable[[], bool] | None = None) -> _CompileLock:
        """The lock for a background compile's job (``with COMPILE_LOCK.after_traces():``),
        taken after every trace waiting for it, and, while ``behind()`` is true (the job's trace
        was held back, see ``Background.hold_back``), after the background compiles of the traces
        that serve. A thread that holds it already (a compile in the foreground, under Dynamo's
        own call of a backend) does not wait: a trace waits for it."""
        if not _compat.holds_compile_lock():
            with self._no_trace_waits:
                self._no_trace_waits.wait_for(
                    lambda: not self._traces and not (self._ahead and behind is not None and behind())
                )
        return self

    def ahead(self, change: int) -> None:
        """A background compile of a trace that serves starts (+1) or ends, or its trace was held
        back (-1): compiles of held-back traces wait while any is counted."""
        with self._no_trace_waits:
            self._ahead += change
            self._no_trace_waits.notify_all()

    def changed(self) -> None:
        """Wakes the compiles waiting in ``after_traces``: what their ``behind`` reads changed."""
        with self._no_trace_waits:
            self._no_trace_waits.notify_all()

    def __enter__(self) -> None:
        lock = _compat.dynamo_compile_lock()
        lock.acquire()
        try:
            # A compile traces with torch.fx, whose "tracing" flag and patches of nn.Module are
            # process-wide: threads serving meanwhile must not see them (see _compat). Made once,
            # under the lock: no other compile is half-way through a trace then.
            _compat.isolate_fx_tracing()
        except BaseException:
            lock.release()
            raise

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        _compat.dynamo_compile_lock().release()


COMPILE_LOCK = _CompileLock()


@contextlib.contextmanager
def between_compiles() -> Iterator[None]:
    """No compile of this process is half-way while the caller reads compiler settings.

    A compile patches Inductor's configuration process-wide for its duration (``max_autotune``
    for a static size): a model fingerprinted meanwhile read the patch as the user's setting, and
    its whole-model artifact went under a fingerprint no later process computes. Waits for the
    compile lock only when Dynamo is loaded: before that, nothing in the process has compiled
    (and a warm start stays free of Dynamo's import).
    """
    if "torch._dynamo.convert_frame" not in sys.modules:
        yield
        return
    with COMPILE_LOCK:
        yield


class DefaultDtypeMoved(RuntimeError):
    """The process's default dtype differs from the trace's where a compile may not set it."""


@dataclasses.dataclass(frozen=True)
class CompileState:
    """What a traced call's compile depends on beyond its graph and inputs.

    Grad mode is not recorded: tessera compiles inference graphs, so every compile runs under
    ``torch.no_grad()`` (the trace itself runs under no_grad or inference_mode, see api.py).
    """

    autocast: tuple[tuple[str, torch.dtype], ...]  # (device type, dtype) for each autocast on
    default_dtype: torch.dtype
    size_oblivious: bool = False  # the trace was size-oblivious: so must its compiles be

    @classmethod
    def current(cls) -> CompileState:
        """The calling thread's state (taken where the trace runs)."""
        autocast, default_dtype, _ = _compat.call_state()  # what the call check compares, too
        return cls(autocast, default_dtype, _compat.size_oblivious_enabled())

    @contextlib.contextmanager
    def applied(self, owns_process: bool = False) -> Iterator[None]:
        """Run a compile under this state: no grad, this autocast, this dtype, and size-oblivious
        reasoning where the trace had it. The default dtype is process-wide, not per thread: it is
        set only where the compile ``owns_process`` (a compile worker); elsewhere a default dtype
        other than the traced one raises ``DefaultDtypeMoved`` (the user's code meanwhile would
        see it changed under it), and what serves keeps serving."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            if self.size_oblivious:
                stack.enter_context(_compat.size_oblivious())
            for device in AUTOCAST_DEVICES:
                if torch.is_autocast_enabled(device) and device not in dict(self.autocast):
                    stack.enter_context(torch.autocast(device, enabled=False))
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            default = torch.get_default_dtype()
            if default != self.default_dtype:
                if not owns_process:
                    raise DefaultDtypeMoved(
                        f"the process's default dtype is {default} now, the trace's was "
                        f"{self.default_dtype}: not compiled here (the compile workers, or the next "
                        "process, compile it under the traced one)"
                    )
                torch.set_default_dtype(self.default_dtype)
                stack.callback(torch.set_default_dtype, default)
            yield
