"""The root module's forward hooks, run around the compiled forward as ``nn.Module.__call__`` would.

tessera traces the module's ``forward`` (so Dynamo never sees root hooks) and runs the root's
pre-forward and forward hooks itself, in eager order, on every call that has any. Hooks on
submodules are traced into the graph at the first call. Backward hooks cannot be kept: refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tessera import _compat
from tessera.errors import TesseraError


def active(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` would run any forward or backward hook of the root."""
    return (
        _compat.has_forward_hooks(module)
        or _compat.has_backward_hooks(module)
        or _compat.global_module_hooks()
    )


def around(module: torch.nn.Module | None, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` as ``module``'s call: between the root's hooks on every call that has any
    (hooks may be added or removed at any time). The one wrap of tessera's three callers."""
    if module is None:
        return forward
    root = module

    def call(*args: Any, **kwargs: Any) -> Any:
        if active(root):
            return call_with_hooks(root, forward, args, kwargs)
        return forward(*args, **kwargs)

    return call


def call_with_hooks(
    module: torch.nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``forward(*args, **kwargs)`` between the root's pre-forward and forward hooks."""
    if _compat.has_backward_hooks(module) or _compat.global_backward_hooks():
        raise TesseraError(
            f"{type(module).__name__} has backward hooks, which a compiled inference forward cannot "
            "keep; remove them, or use mode='stock' (torch.compile keeps them)"
        )
    pre_hooks, hooks, pre_with_kwargs, with_kwargs = _compat.forward_hooks(module)
    for hook_id, hook in pre_hooks:
        if hook_id in pre_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise TesseraError(
                        f"forward pre-hook {hook!r} with kwargs must return None or (args, kwargs), "
                        f"got {result!r}"
                    )
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    output = forward(*args, **kwargs)
    for hook_id, hook in hooks:
        result = hook(module, args, kwargs, output) if hook_id in with_kwargs else hook(module, args, output)
        if result is not None:
            output = result
    return output
