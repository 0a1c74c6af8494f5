"""nn.Module's hooks, torch's structured trace, the order of the exit's hooks and Dynamo's clean-up
at exit.

Part of tessera._compat (see its docstring): the names are used as ``_compat.<name>``.
"""

from __future__ import annotations

import logging
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


def before_thread_joins(fn: Callable[[], None]) -> None:
    """Have the interpreter's exit run ``fn`` before it joins non-daemon threads (tessera's
    background threads then stop at their next step instead of holding the exit up).

    Reason: ``atexit`` hooks run only after ``threading._shutdown`` has joined every non-daemon
    thread; ``threading._register_atexit`` (private to CPython 3.9+) registers a hook that runs
    first, the one ``concurrent.futures`` uses to stop its pools. Without it (another
    interpreter) ``fn`` goes to ``atexit``, and a background thread then ends its work first.
    Hooks run last-registered first: the pools' modules are imported before ``fn`` is registered,
    so ``fn`` runs while they still take work (a compile it waits for submits to them).
    Checked on torch 2.11, 2.13 (CPython 3.11-3.13's private hook; no torch API).
    """
    import concurrent.futures.process
    import concurrent.futures.thread  # noqa: F401

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(fn)
            return
        except RuntimeError:  # "can't register atexit after shutdown"
            return
    import atexit

    atexit.register(fn)


def interpreter_exiting() -> bool:
    """Whether the interpreter has begun to exit (its exit hooks run, or the main thread ended).

    Reason: during ``threading._shutdown``'s exit hooks (where ``join_before_pools_shut``'s joins
    run) CPython 3.11 still reports the main thread alive; the private ``threading._SHUTTING_DOWN``
    is set first. Checked on torch 2.11, 2.13 (CPython 3.10-3.13's private flag; no torch API)."""
    return bool(getattr(threading, "_SHUTTING_DOWN", False)) or not threading.main_thread().is_alive()


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
