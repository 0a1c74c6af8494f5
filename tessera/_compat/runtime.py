"""nn.Module's hooks, torch's structured trace, the order of thread joins at exit, Dynamo's deferred
full collections, OpenMP's thread count and the long loops a trace runs without a Python call.

Part of tessera._compat (see its docstring): the names are used as ``_compat.<name>``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as nn_module  # loaded by `import torch`; read on every call

log = logging.getLogger(__name__)


# -- nn.Module hooks ----------------------------------------------------------------------------
# The hook dicts nn.Module.__call__ reads (torch 2.11-2.13, torch/nn/modules/module.py): tessera
# calls the root's forward directly, so it runs the root's hooks itself, in the same order.
def global_module_hooks() -> bool:
    """Whether any global forward or backward module hook is registered.

    Checked on torch 2.11, 2.13: the private ``_global_*_hooks`` dicts; no public accessor.
    """
    return bool(
        nn_module._global_forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    )


def global_backward_hooks() -> bool:
    """Whether any global backward or pre-backward module hook is registered.

    Checked on torch 2.11, 2.13: the private ``_global_backward*_hooks`` dicts; no public accessor.
    """
    return bool(nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward or pre-forward hooks of its own (``Module._forward_hooks``
    and ``_forward_pre_hooks``; no public accessor). Checked on torch 2.11-2.15."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


def has_backward_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has backward or pre-backward hooks of its own (``Module._backward_hooks``
    and ``_backward_pre_hooks``; no public accessor). Checked on torch 2.11-2.15."""
    return bool(module._backward_hooks or module._backward_pre_hooks)


def forward_hooks(
    module: torch.nn.Module,
) -> tuple[list[tuple[int, Any]], list[tuple[int, Any]], set[int], set[int]]:
    """(pre-hooks, hooks, pre-hook ids taking kwargs, hook ids taking kwargs), globals first.

    Checked on torch 2.11, 2.13: the private hook dicts ``nn.Module.__call__`` reads; no public API.
    """
    from torch.nn.modules import module as nn_module

    pre_hooks = [*nn_module._global_forward_pre_hooks.items(), *module._forward_pre_hooks.items()]
    hooks = [*nn_module._global_forward_hooks.items(), *module._forward_hooks.items()]
    pre_with_kwargs = set(module._forward_pre_hooks_with_kwargs)
    with_kwargs = set(module._forward_hooks_with_kwargs) | set(nn_module._global_forward_hooks_with_kwargs)
    return pre_hooks, hooks, pre_with_kwargs, with_kwargs


# -- torch's structured trace (TORCH_TRACE, read by tlparse) ---------------------------------------
def trace_artifact(name: str, payload: Callable[[], str], in_compile: bool = True) -> None:
    """An artifact in torch's structured trace (``torch._logging.trace_structured``).

    Costs a handler check when ``TORCH_TRACE`` is not set. ``in_compile``: emitted inside
    Dynamo's compile of the model (attributed to its compile id).

    Checked on torch 2.11, 2.13: private; no public way to add to ``TORCH_TRACE``.
    """
    from torch._logging import trace_structured  # type: ignore[attr-defined]

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": name, "encoding": "string"},
        payload_fn=payload,
        expect_trace_id=in_compile,
    )


def join_before_pools_shut(thread: threading.Thread) -> bool:
    """Have the interpreter's exit wait for ``thread`` before thread and process pools refuse work;
    False when the exit's hooks already run (too late to add one: the caller must see to it).

    Reason: at exit, ``threading._shutdown`` runs its exit hooks before it joins non-daemon threads,
    and ``concurrent.futures``'s hook makes every pool refuse new work ("cannot schedule new futures
    after interpreter shutdown"). Inductor's compile submits to such pools, so a background compile
    still running when the main thread ends would fail. Hooks run last-registered first: the pool
    modules are imported before ours is registered, so ours runs before theirs.
    (``threading._register_atexit`` is private to CPython; without it, the compile may fail at exit,
    which is logged, and the next process compiles what is missing.)

    Checked on torch 2.11, 2.13; reads no torch API (the private part is CPython's).
    """
    import concurrent.futures.process
    import concurrent.futures.thread  # noqa: F401

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return True  # nothing this interpreter lets us order
    try:
        register(thread.join)
    except RuntimeError:  # "can't register atexit after shutdown"
        return False
    return True


def interpreter_exiting() -> bool:
    """Whether the interpreter has begun to exit (its exit hooks run, or the main thread ended).

    Reason: during ``threading._shutdown``'s exit hooks (where ``join_before_pools_shut``'s joins
    run) CPython 3.11 still reports the main thread alive; the private ``threading._SHUTTING_DOWN``
    is set first. Checked on torch 2.11, 2.13 (CPython 3.10-3.13's private flag; no torch API)."""
    return bool(getattr(threading, "_SHUTTING_DOWN", False)) or not threading.main_thread().is_alive()


# -- Dynamo's deferred full collections --------------------------------------------------------
def swap_deferred_gc_threshold(when: int | None, new: int) -> int | None:
    """The oldest generation's threshold Dynamo saved when its running compile raised it, or None
    when no compile holds one; made ``new`` when it was ``when`` (any, for None).

    Reason: from torch 2.15, Dynamo raises that threshold while it compiles and puts back what it
    saved when its outermost compile ends (``torch._dynamo.utils.deferred_full_gc``, process-wide,
    like tessera's ``heap.Heap``). A compile that began while tessera held full collections off
    saved tessera's raised threshold, and put it back for good after tessera's window closed: no
    full collection ran again in that process (seen on torch 2.15.0, a background trace ending
    between a compile's start and end). A compile that began before tessera's window put the
    threshold down inside it. The heap swaps the saved value at both ends of its window, under
    Dynamo's own lock. Dynamo not imported: no compile runs. Checked on torch 2.13.0 (absent:
    None) and 2.15.0 (``_gc_threshold_lock``, ``_gc_threshold_saved``).
    """
    utils = sys.modules.get("torch._dynamo.utils")
    lock = getattr(utils, "_gc_threshold_lock", None)
    if lock is None:
        return None
    with lock:
        saved = getattr(utils, "_gc_threshold_saved", None)
        if saved is None:
            return None
        if when is None or saved[2] == when:
            utils._gc_threshold_saved = (*saved[:2], new)  # type: ignore[union-attr]
        return int(saved[2])


# -- Dynamo's clean-up at exit ----------------------------------------------------------------
def keep_dynamo_names_at_exit(module: str) -> None:
    """At the interpreter's exit: drop Dynamo's clean-up hooks for the names it installed in the
    globals of ``module``'s frames (those whose ``__name__`` it is). The names stay, and the
    globals end with the process.

    Reason: torch 2.15's hook (``torch._dynamo.utils.CleanupHook``, run when a compiled code object
    dies) reads its module's ``_cleanup_owners``, which CPython's teardown sets to None before the
    module's other names (an underscore's go first). A code object that dies after that, one a
    compiled model kept until ``__main__`` was torn down, printed "Exception ignored in ...
    'NoneType' object has no attribute 'pop'" as the process exited (seen on torch 2.15.0 after a
    failed and retried trace). Checked on torch 2.13.0 (no ``_cleanup_owners``: nothing to drop)
    and 2.15.0 (``CleanupManager.instance.values``: code id -> its list of hooks).
    """
    utils = sys.modules.get("torch._dynamo.utils")
    if getattr(utils, "_cleanup_owners", None) is None:
        return
    for hooks in list(utils.CleanupManager.instance.values.values()):  # type: ignore[union-attr]
        if isinstance(hooks, list):
            hooks[:] = [hook for hook in hooks if getattr(hook, "scope", {}).get("__name__") != module]


# -- OpenMP's thread count ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OpenMP:
    """The OpenMP runtime torch's CPU ops run on: the calling thread's team size, read and set.
    Checked on torch 2.13, 2.14.1: see ``openmp_runtime``."""

    path: str
    get_threads: Callable[[], int]  # omp_get_max_threads
    set_threads: Callable[[int], None]  # omp_set_num_threads


# The OpenMP runtimes a torch build loads: GNU's in the Linux wheels, LLVM's or Intel's elsewhere.
# Checked on torch 2.13, 2.14.1 (libgomp).
_OPENMP_NAMES = ("libgomp", "libomp", "libiomp5")


@functools.cache
def openmp_runtime() -> OpenMP | None:
    """The OpenMP runtime this process's torch loaded, or None (a build on another parallel
    backend, or none found).

    Checked on torch 2.13 (CPU) and 2.14.1 (CUDA build): both load ``torch/lib/libgomp.so.1``.
    ``torch.set_num_threads`` is no substitute: it also sets a process-wide count that every thread
    reads at its first parallel op and that Inductor's code generation reads (``num_threads(N)``
    is then written into the kernels), where ``omp_set_num_threads`` sets the calling thread's
    count only (OpenMP's ``nthreads-var`` is a per-thread setting). No public torch API sets one
    thread's count.
    """
    if not torch.backends.openmp.is_available():  # type: ignore[no-untyped-call]  # untyped in torch
        return None
    for path in _loaded_libraries():
        if os.path.basename(path).startswith(_OPENMP_NAMES):
            try:
                library = ctypes.CDLL(path)  # already loaded by torch: the same handle
                get_threads, set_threads = library.omp_get_max_threads, library.omp_set_num_threads
            except (OSError, AttributeError) as e:
                log.debug("OpenMP runtime %s not usable: %s", path, e)
                continue
            get_threads.restype, get_threads.argtypes = ctypes.c_int, []
            set_threads.restype, set_threads.argtypes = None, [ctypes.c_int]
            return OpenMP(path, get_threads, set_threads)
    return None


def _loaded_libraries() -> list[str]:
    """The shared libraries mapped into this process (Linux), torch's own first (another
    extension may map an OpenMP runtime of its own), else those torch ships beside it.
    Checked on torch 2.13, 2.14.1: ``torch/lib`` holds them (``torch.libs`` in older wheels)."""
    package = os.path.dirname(os.path.dirname(torch.__file__))
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
        return sorted(paths, key=lambda path: (not path.startswith(package + os.sep + "torch"), path))
    except OSError:
        library_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
        try:
            return sorted(os.path.join(library_dir, name) for name in os.listdir(library_dir))
        except OSError:
            return []


# -- long loops without a call ------------------------------------------------------------------
# The functions a Dynamo trace runs for milliseconds without entering another Python function, so
# that a trace function on 'call' events alone (pacing.py) gets no chance to give way in them:
# pacing traces their lines. Found by timing the gaps between a paced trace's 'call' events (tiny
# BERT and ViT, Python 3.11, torch 2.13), each run once per process:
# - ``torch._dynamo.funcname_cache._add_file``: Dynamo names each traced line's function from the
#   tokens of its whole source file, ``tokenize._tokenize`` making them (a long docstring is read
#   with no call at all) and a loop over them: 1-7 ms per file;
# - ``torch.overrides.get_testing_overrides``: one dict literal of a thousand lambdas, 5 ms;
# - ``torch.overrides._get_overridable_functions``: a loop over torch's namespaces, 2-3 ms.
# Each by its name and the end of its file's path, so that none need be imported to be known
# (torch._dynamo is imported by the paced trace itself); a name a version lacks is never met.
# Checked on torch 2.13, 2.15, CPython 3.11 (3.12 tokenizes in one C call: nothing to trace).
LONG_RUNNING = {
    "_tokenize": "tokenize.py",
    "_add_file": "funcname_cache.py",
    "get_testing_overrides": "overrides.py",
    "_get_overridable_functions": "overrides.py",
}
