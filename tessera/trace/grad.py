"""The grad policy: tessera compiles inference graphs, so a call whose result would need
gradients is refused, and one whose result would not runs its graph under ``no_grad``."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def as_inference(name: str, owner: Any, tensors: Callable[[], Iterable[Any]], run: Callable[[], T]) -> T:
    """The grad policy, the one copy (a traced model's first call, its later calls, the guarded
    path): with grad enabled, refuse a call one of whose ``tensors()`` requires grad, and run any
    other under ``no_grad`` (its inference graph gives eager's result); with grad off, just run.
    ``torch.compile(backend="tessera")`` differs on purpose (dynamo_backend.py): Dynamo hands it a
    graph that must carry gradients, and torch's own backend compiles that one instead."""
    if not torch.is_grad_enabled():
        return run()
    refuse_if_grad_needed(name, owner, tensors())
    with torch.no_grad():
        return run()


def refuse_if_grad_needed(name: str, owner: Any, tensors: Any) -> None:
    """Raise GradientsNotSupportedError when a tensor the call reads requires grad (grad is on).
    ``owner``: the module whose parameter names say which one it is."""
    needing = next((t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad), None)
    if needing is None:
        return
    from tessera.trace import call_check  # the refusal only: a first call served eagerly does not need it

    names = {id(p): n for n, p in owner.named_parameters()} if isinstance(owner, torch.nn.Module) else {}
    what = f"parameter {names[id(needing)]}" if id(needing) in names else call_check.short_repr(needing)
    raise call_check.GradientsNotSupportedError(
        f"{name}: called with grad enabled and {what} requires grad, so eager's result "
        "would carry gradients. tessera "
        "compiles inference graphs: call it under torch.inference_mode() or torch.no_grad(), "
        "freeze the parameters (model.requires_grad_(False)), or use mode='stock' to train"
    )


def grad_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor ``obj`` holds that could carry gradients: tensors in containers, a module's
    parameters and buffers, a function's closure (bounded depth: this runs with grad enabled)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
    elif depth > 4:
        return
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from grad_tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from grad_tensors(item, depth + 1)
    elif isinstance(obj, types.MethodType):
        yield from grad_tensors(obj.__self__, depth + 1)
        yield from grad_tensors(obj.__func__, depth + 1)
    elif isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from grad_tensors(contents, depth + 1)
