"""torch.fx's tracing state, made per thread (an FX trace in one thread must not be seen by others).

Part of tessera._compat (see its docstring): the names are used as ``_compat.<name>``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tessera._compat.patches import Undo, apply, patch

log = logging.getLogger(__name__)


# Checked on torch 2.11, 2.13: tessera's own per-thread depth of torch.fx's ``Tracer.trace``.
_FX_TRACING_HERE = threading.local()  # per thread: how deep in torch.fx's Tracer.trace it is


def _tracing_in_this_thread() -> bool:
    """Whether this thread is inside ``Tracer.trace``: what ``isolate_fx_tracing_flag`` installs in
    the private ``torch.fx._symbolic_trace``. Checked on torch 2.11, 2.13."""
    return getattr(_FX_TRACING_HERE, "depth", 0) > 0


def isolate_fx_tracing_flag() -> None:
    """Install ``fx_tracing_flag`` (below) where this torch needs it. Checked on torch 2.11, 2.13."""
    apply("fx_tracing_flag")


@patch("fx_tracing_flag", "torch.fx's tracing flag answers per thread", "2.11-2.13")
def _fx_tracing_flag() -> Undo | None:
    """Make torch.fx's "an FX trace is running" flag answer for the calling thread only.

    Reason: on torch 2.11-2.13 ``torch.fx._symbolic_trace._is_fx_tracing_flag`` is one process-wide
    bool set by ``Tracer.trace``, which every compile runs (AOTAutograd's make_fx). While a
    background compile traces, a call in another thread of any ``torch.compile``'d function reads
    it and raises "Detected that you are using FX to symbolically trace a dynamo-optimized
    function" (pytorch/pytorch#126024). torch 2.14 made the flag thread-local
    (pytorch/pytorch#168999); there this does nothing. On older torch, ``Tracer.trace`` counts its
    depth per thread, and the flag's two readers (``is_fx_tracing``, ``is_fx_symbolic_tracing``)
    are given code that also asks that count. Their code objects are replaced, not the functions:
    Dynamo keys tables on these function objects, and ``torch.compile`` wrappers made before
    this ran hold them. Remove when 2.13 leaves the supported range.

    Checked on torch 2.11, 2.13.
    """
    module = sys.modules.get("torch.fx._symbolic_trace")
    if module is None or not hasattr(module, "_is_fx_tracing_flag") or hasattr(module, "_is_fx_tracing_tls"):
        return None
    tracer = module.Tracer
    original = tracer.trace
    if getattr(original, "_tessera_counts_depth", False):
        return None
    codes = (module.is_fx_tracing.__code__, module.is_fx_symbolic_tracing.__code__)

    @functools.wraps(original)
    def trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_FX_TRACING_HERE, "depth", 0)
        _FX_TRACING_HERE.depth = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _FX_TRACING_HERE.depth = depth

    trace._tessera_counts_depth = True  # type: ignore[attr-defined]
    tracer.trace = trace
    # The readers' new code runs in torch.fx._symbolic_trace's globals: the one name it adds there.
    module.__dict__["_tessera_tracing_in_this_thread"] = _tracing_in_this_thread

    def is_fx_tracing() -> bool:
        is_fx_tracing_warning()  # type: ignore[name-defined]  # noqa: F821  (a name of that module)
        return bool(
            _is_fx_tracing_flag  # type: ignore[name-defined]  # noqa: F821
            and _tessera_tracing_in_this_thread()  # type: ignore[name-defined]  # noqa: F821
        )

    def is_fx_symbolic_tracing() -> bool:
        return bool(
            _is_fx_tracing_flag  # type: ignore[name-defined]  # noqa: F821
            and _tessera_tracing_in_this_thread()  # type: ignore[name-defined]  # noqa: F821
            and not torch.compiler.is_compiling()
        )

    module.is_fx_tracing.__code__ = is_fx_tracing.__code__
    module.is_fx_symbolic_tracing.__code__ = is_fx_symbolic_tracing.__code__

    def undo() -> None:
        tracer.trace = original
        module.is_fx_tracing.__code__, module.is_fx_symbolic_tracing.__code__ = codes
        module.__dict__.pop("_tessera_tracing_in_this_thread", None)

    return undo


def isolate_fx_patches() -> None:
    """Install ``fx_patches`` (below) where this torch needs it. Checked on torch 2.13."""
    apply("fx_patches")


@patch("fx_patches", "torch.fx's patches of nn.Module act in the tracing thread only", "2.11-2.15")
def _fx_patches() -> Undo | None:
    """Make the methods torch.fx patches on classes while it traces act in the tracing thread only.

    Reason: for the length of a trace, ``Tracer.trace`` replaces ``torch.nn.Module.__call__`` and
    ``__getattr__`` on the class, process-wide, through the private ``_Patcher.patch_method``
    (``_Patcher`` dates from pytorch/pytorch#50793, 2021: without it this does nothing).
    Every compile traces: AOTAutograd's make_fx, and Inductor's ``symbolic_trace`` of a one-line
    function (``loop_body.InterpreterShim._dummy_gm``, once per process, in the first compile that
    analyses a loop's index bounds: a static size). A module called meanwhile in another thread
    (the user's eager model, a piece served as traced while it compiles in the background) entered
    that trace: the plain ``Tracer`` looks it up under its own root and raises ``NameError: module
    is not installed as a submodule``; make_fx's tracer runs it through its own bookkeeping. Here
    each method patched on a class is installed behind a function that calls the tracer's wrapper
    in the thread that patched and, in any other thread, what the class had before. The tracing
    thread sees no change, nested traces and Dynamo's revert and reapply of the patches included
    (``_maybe_revert_all_patches`` reads the process-wide ``CURRENT_PATCHER``: safe because every
    compile, Dynamo's and tessera's, holds Dynamo's compile lock). Patches of module globals
    (``torch.fx.wrap``, autowrapped ``math`` functions) stay as they are: their wrappers act on a
    ``Proxy`` argument only, which another thread never has. Two FX traces in two threads at once
    stay unsupported (torch undoes patches in its own order). pytorch/pytorch#187589 proposes the
    same upstream (a thread-local patcher); remove once every supported torch has it.

    Checked on torch 2.13 only (``_Patcher`` was read there alone).
    """
    import torch.fx._symbolic_trace as module  # loaded by ``import torch``

    patcher = getattr(module, "_Patcher", None)
    original = getattr(patcher, "patch_method", None)
    if original is None or getattr(original, "_tessera_this_thread_only", False):
        return None

    @functools.wraps(original)
    def patch_method(
        self: Any, cls: type, name: str, new_fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        return original(self, cls, name, _in_this_thread_only(new_fn, getattr(cls, name)), *args, **kwargs)

    patch_method._tessera_this_thread_only = True  # type: ignore[attr-defined]
    patcher.patch_method = patch_method  # type: ignore[union-attr]

    def undo() -> None:
        patcher.patch_method = original  # type: ignore[union-attr]

    return undo


def _in_this_thread_only(patched: Callable[..., Any], previous: Callable[..., Any]) -> Callable[..., Any]:
    """``patched`` when called from the calling thread, ``previous`` from any other.

    Checked on torch 2.13 (as part of ``isolate_fx_patches``); reads no torch API itself.
    """
    owner = threading.get_ident()

    @functools.wraps(patched)
    def this_thread_only(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == owner:
            return patched(*args, **kwargs)
        return previous(*args, **kwargs)

    return this_thread_only


@functools.cache
def settle_device_guards() -> None:
    """Install the no-op CUDA device guard a fake-tensor trace installs, from the calling thread,
    before a background thread traces.

    Reason: without a usable GPU, ``FakeTensorMode.__enter__`` calls the private
    ``torch._C._ensureCUDADeviceGuardSet()``. On a CUDA build of torch 2.11 with no GPU, its first
    call in a thread other than the main one crashed the process (a segfault, seen in the trace
    made beside eager, tests/test_eager_first.py); once called on the main thread, later calls
    in any thread were fine. So the thread that starts a background thread calls it first, under
    the same condition torch does. Checked on torch 2.11 (CUDA build, no GPU) and 2.13 (CPU)."""
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is not None and not torch.cuda.is_available():
        ensure()


def isolate_fx_tracing() -> None:
    """What one thread's FX trace changes process-wide, seen by that thread only: the tracing flag
    (``isolate_fx_tracing_flag``) and the patched ``nn.Module`` methods (``isolate_fx_patches``).
    Called under ``compile_state.COMPILE_LOCK`` (every compile of tessera's) and before a compile
    thread starts: one cache lookup after the first call. Checked on torch 2.11, 2.13 (the patches
    part on 2.13 only): see the two it calls for the private state each wraps."""
    isolate_fx_tracing_flag()
    isolate_fx_patches()
    isolate_compiling_flag()


# Checked on torch 2.13: tessera's own per-thread depth of Dynamo's ``_compile_session_context``.
_COMPILING_HERE = threading.local()  # per thread: how deep in Dynamo's compile session it is


def _compiling_in_this_thread() -> bool:
    """Whether this thread is in a Dynamo compile session: what ``isolate_compiling_flag`` installs
    in the private ``torch.compiler``. Checked on torch 2.13."""
    return getattr(_COMPILING_HERE, "depth", 0) > 0


def isolate_compiling_flag() -> None:
    """Install ``compiling_flag`` (below) where this torch needs it. Checked on torch 2.13."""
    apply("compiling_flag")


@patch("compiling_flag", "torch.compiler.is_compiling answers per thread", "2.13")
def _compiling_flag() -> Undo | None:
    """Make ``torch.compiler.is_compiling()`` answer for the calling thread only.

    Reason: torch 2.13 holds the process-wide ``torch.compiler._is_compiling_flag`` True for the
    length of a Dynamo compile (``_compile_session_context``). While a trace runs in a background
    thread (beside eager, beside.py), code in another thread that asks ``is_compiling()`` (tessera's
    own ``CompiledModel.__call__``, a Hugging Face model's ``is_torchdynamo_compiling()``) took the
    traced branch at eager runtime. Here the session context also counts its depth per thread, and
    ``is_compiling``'s code (not the function: Dynamo folds calls to that object into a constant)
    also asks that count. Where torch has no such session flag (before 2.13) this does nothing.

    Checked on torch 2.13.
    """
    module = sys.modules.get("torch.compiler")
    original = getattr(module, "_compile_session_context", None)
    if module is None or original is None or not hasattr(module, "_is_compiling_flag"):
        return None
    code = module.is_compiling.__code__

    @contextlib.contextmanager
    def session() -> Iterator[None]:
        depth = getattr(_COMPILING_HERE, "depth", 0)
        _COMPILING_HERE.depth = depth + 1
        try:
            with original():
                yield
        finally:
            _COMPILING_HERE.depth = depth

    setattr(module, "_compile_session_context", session)  # noqa: B010  (a private name of torch's)
    module.__dict__["_tessera_compiling_in_this_thread"] = _compiling_in_this_thread

    def is_compiling() -> bool:
        if torch.jit.is_scripting():  # type: ignore[attr-defined]
            return False
        return bool(
            _is_compiling_flag  # type: ignore[name-defined]  # noqa: F821  (a name of that module)
            and _tessera_compiling_in_this_thread()  # type: ignore[name-defined]  # noqa: F821
        )

    module.is_compiling.__code__ = is_compiling.__code__

    def undo() -> None:
        setattr(module, "_compile_session_context", original)  # noqa: B010  (as above)
        module.is_compiling.__code__ = code
        module.__dict__.pop("_tessera_compiling_in_this_thread", None)

    return undo


def graph_source(gm: torch.fx.GraphModule) -> str:
    """``gm.code`` without compiling it: the Python source of ``gm.forward``.

    Reason: Dynamo hands backends a ``_LazyGraphModule`` whose ``forward`` is compiled from its
    source on first use, and reading ``.code`` forces that: one ``compile()`` of the whole graph's
    source, a C call that holds the GIL for its length (tens of ms for a 16-layer toy Llama's
    1,370 lines), so a call served beside the trace waits for all of it. The source
    alone is ``graph.python_code`` (Python, which gives way). Where torch's profiler metadata
    option changes what ``recompile`` generates, or the module is not lazy or already compiled,
    ``.code`` itself is read. Checked on torch 2.11, 2.13.
    """
    from torch.fx._lazy_graph_module import _LazyGraphModule

    config = sys.modules.get("torch.fx.experimental._config")
    if (
        not isinstance(gm, _LazyGraphModule)
        or not gm._needs_recompile()
        or getattr(config, "enrich_profiler_metadata", False)
    ):
        return gm.code
    return gm.graph.python_code(root_module="self").src


def compile_graph_now(gm: torch.fx.GraphModule) -> None:
    """Compile a lazy graph module's ``forward`` now, in this thread, not at its first call.

    Reason: a ``_LazyGraphModule`` (what Dynamo and ``split_module`` make of a lazy graph)
    compiles its source at its first call (code generation, then one GIL-holding ``compile()``);
    the split module's and its pieces' first call is a served one (52 ms of a 6 ms toy Llama call,
    9 pieces). Made in the background thread that builds them, the served call does not pay.
    Checked on torch 2.11, 2.13 (``_LazyGraphModule.force_recompile``).
    """
    from torch.fx._lazy_graph_module import _LazyGraphModule

    force = getattr(_LazyGraphModule, "force_recompile", None)
    if force is not None:  # another torch: the first call compiles it, as torch does by default
        force(gm)
