"""tessera: trace a PyTorch model once, split it at attention, compile the pieces, start warm.

Public API: ``compile``, ``CompileConfig``, ``counters`` and the error types.
"""

from __future__ import annotations

from tessera import counters
from tessera.api import CompiledModel, compile
from tessera.config import CompileConfig, SizeRange
from tessera.errors import (
    CacheError,
    CompilerError,
    ConfigError,
    SizeNotCompiledError,
    TesseraError,
    UnsupportedModelError,
)
from tessera.piece import PieceRecord

__version__ = "0.1.0"

__all__ = [
    "CacheError",
    "CompileConfig",
    "CompiledModel",
    "CompilerError",
    "ConfigError",
    "PieceRecord",
    "SizeNotCompiledError",
    "SizeRange",
    "TesseraError",
    "UnsupportedModelError",
    "compile",
    "counters",
]
