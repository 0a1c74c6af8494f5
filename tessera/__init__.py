"""tessera: trace a PyTorch model once, split it at attention, compile the pieces, start warm.

Public API: ``compile``, ``CompileConfig``, ``counters`` and the error types. Names are imported
on first use, so that ``import tessera`` (or one of its submodules) costs next to nothing.
"""

from __future__ import annotations

import importlib
import time
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
# When tessera was imported (wall-clock seconds): where a platform does not say when the process
# started, the report's timeline starts here (report.process_start).
IMPORTED_AT = time.time()

_EXPORTS = {
    "ArtifactDamaged": "tessera.errors",
    "CacheError": "tessera.errors",
    "CallArgumentsError": "tessera.errors",
    "CompileConfig": "tessera.config",
    "CompileReport": "tessera.report",
    "CompiledModel": "tessera.api",
    "CompilerError": "tessera.errors",
    "ConfigError": "tessera.errors",
    "FallbackWarning": "tessera.errors",
    "GradientsNotSupportedError": "tessera.trace.call_check",
    "InputMismatchError": "tessera.trace.call_check",
    "PieceRecord": "tessera.compilation.piece",
    "SizeNotCompiledError": "tessera.errors",
    "SizeRange": "tessera.config",
    "StateMismatchError": "tessera.trace.call_check",
    "TesseraError": "tessera.errors",
    "TesseraWarning": "tessera.errors",
    "TraceLimitWarning": "tessera.errors",
    "UnsupportedArgumentError": "tessera.errors",
    "UnsupportedModelError": "tessera.errors",
    "UntestedTorchWarning": "tessera.errors",
    "compile": "tessera.api",
}
# Submodules reachable as attributes (``tessera.passes.DeduplicatePass``), imported on first use.
_SUBMODULES = {
    "counters": "tessera.counters",
    "debug": "tessera.debug",
    "dynamo_backend": "tessera.trace.dynamo_backend",
    "hf": "tessera.hf",
    "passes": "tessera.passes",
}

__all__ = [
    "ArtifactDamaged",
    "CacheError",
    "CallArgumentsError",
    "CompileConfig",
    "CompileReport",
    "CompiledModel",
    "CompilerError",
    "ConfigError",
    "FallbackWarning",
    "GradientsNotSupportedError",
    "InputMismatchError",
    "PieceRecord",
    "SizeNotCompiledError",
    "SizeRange",
    "StateMismatchError",
    "TesseraError",
    "TesseraWarning",
    "TraceLimitWarning",
    "UnsupportedArgumentError",
    "UnsupportedModelError",
    "UntestedTorchWarning",
    "compile",
    "counters",
    "debug",
    "passes",
]

if TYPE_CHECKING:
    from tessera import counters, debug, passes
    from tessera.api import CompiledModel, compile
    from tessera.compilation.piece import PieceRecord
    from tessera.config import CompileConfig, SizeRange
    from tessera.errors import (
        ArtifactDamaged,
        CacheError,
        CallArgumentsError,
        CompilerError,
        ConfigError,
        FallbackWarning,
        SizeNotCompiledError,
        TesseraError,
        TesseraWarning,
        TraceLimitWarning,
        UnsupportedArgumentError,
        UnsupportedModelError,
        UntestedTorchWarning,
    )
    from tessera.report import CompileReport
    from tessera.trace.call_check import GradientsNotSupportedError, InputMismatchError, StateMismatchError


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = _imported(_SUBMODULES[name])
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tessera' has no attribute {name!r}")
    value = getattr(_imported(module), name)
    globals()[name] = value
    return value


def _imported(module: str) -> Any:
    """``module``, imported with the cyclic garbage collector paused. Reason: a first
    ``tessera.compile`` imports some fifty modules of ours after torch; their allocations trigger
    full collections of torch's large heap (a third of the import),
    which find nothing to free (modules live as long as the process), and the first output waits
    for them."""
    import gc

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return importlib.import_module(module)
    finally:
        if was_enabled:
            gc.enable()
