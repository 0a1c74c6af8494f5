"""What Dynamo's saved bytecode calls, served without importing Dynamo (the warm start).

Part of tessera._compat (see its docstring): the names are used as ``_compat.<name>``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


# Helpers Dynamo's transformed bytecode calls through ``__import_torch_dot__dynamo_dot_utils``
# (torch 2.11-2.13). Served here so that running saved bytecode never imports Dynamo; any other
# attribute falls through to the real module. Each mirrors torch/_dynamo/utils.py.
def _call_size(x: Any, i: int) -> int:
    """Mirrors ``torch._dynamo.utils.call_size``. Checked on torch 2.11, 2.13; no public API."""
    return x.size(i)  # type: ignore[no-any-return]


def _call_stride(x: Any, i: int) -> int:
    """Mirrors ``torch._dynamo.utils.call_stride``. Checked on torch 2.11, 2.13; no public API."""
    return x.stride(i)  # type: ignore[no-any-return]


def _call_storage_offset(x: Any) -> int:
    """Mirrors ``torch._dynamo.utils.call_storage_offset``. Checked on torch 2.11, 2.13."""
    return x.storage_offset()  # type: ignore[no-any-return]


def _record_pregraph_bytecode_enter() -> Any:
    """Mirrors ``torch._dynamo.utils.record_pregraph_bytecode_enter``. Checked on torch 2.11, 2.13:
    private ``_RecordFunctionFast`` and ``autograd.profiler._is_profiler_enabled``."""
    cm: Any = (
        torch._C._profiler._RecordFunctionFast("Pregraph bytecode")
        if torch.autograd.profiler._is_profiler_enabled
        else contextlib.nullcontext()
    )
    cm.__enter__()
    return cm


def _record_pregraph_bytecode_exit(cm: Any) -> None:
    """Mirrors ``torch._dynamo.utils.record_pregraph_bytecode_exit``. Checked on torch 2.11, 2.13."""
    cm.__exit__(None, None, None)


def _object_setattr_ignore_descriptor(obj: Any, name: str, value: Any) -> None:
    """Mirrors ``torch._dynamo.utils.object_setattr_ignore_descriptor``. Checked on torch 2.11, 2.13."""
    try:
        d = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        if not isinstance(obj, threading.local):
            raise
        d = threading.local.__getattribute__(obj, "__dict__")
    d[name] = value


# Checked on torch 2.11, 2.13: the private ``torch._dynamo.utils`` names saved bytecode calls.
DYNAMO_UTILS_HELPERS: dict[str, Callable[..., Any]] = {
    "call_size": _call_size,
    "call_stride": _call_stride,
    "call_storage_offset": _call_storage_offset,
    "record_pregraph_bytecode_enter": _record_pregraph_bytecode_enter,
    "record_pregraph_bytecode_exit": _record_pregraph_bytecode_exit,
    "object_setattr_ignore_descriptor": _object_setattr_ignore_descriptor,
}


class LazyModule(types.ModuleType):
    """Stands in for a module that saved bytecode reads: known helpers without importing it.

    Any attribute not in ``helpers`` imports the real module (correct, only slower).

    Checked on torch 2.11, 2.13: stands in for private ``torch._dynamo`` modules, which saved bytecode
    reads through Dynamo's ``__import_*`` globals; no public API runs saved bytecode.
    """

    def __init__(self, name: str, helpers: dict[str, Callable[..., Any]]) -> None:
        super().__init__(name)
        self.__dict__.update(helpers)
        self._tessera_real = name

    def __getattr__(self, attr: str) -> Any:
        import importlib

        log.debug("saved bytecode reads %s.%s: importing %s", self._tessera_real, attr, self._tessera_real)
        return getattr(importlib.import_module(self._tessera_real), attr)


def module_for_bytecode(name: str) -> types.ModuleType:
    """The module object saved bytecode should see for ``name`` (Dynamo's own: a lazy stand-in).

    Checked on torch 2.11, 2.13: ``torch._dynamo.*`` modules are private; no public API.
    """
    import importlib

    if name in sys.modules:
        return sys.modules[name]
    if name == "torch._dynamo.utils":
        return LazyModule(name, DYNAMO_UTILS_HELPERS)
    if name.startswith("torch._dynamo"):
        return LazyModule(name, {})
    return importlib.import_module(name)
