"""Post-grad passes: your graph rewrites, run by Inductor on every compile of every piece.

A pass is a callable ``pass_(graph: torch.fx.Graph) -> None`` with a ``uuid()`` naming its
version (it enters the cache key: a new uuid misses exactly the entries the pass touched). It may
define ``applies_to(size) -> bool`` to run only for some sizes; ``compiling_size()`` tells it the
size or range being compiled. tessera ships ``DeduplicatePass`` (common subexpressions).
"""

from __future__ import annotations

from tessera.passes.dedup import DeduplicatePass
from tessera.passes.manager import Pass, compiling_size, pass_manager

__all__ = ["DeduplicatePass", "Pass", "compiling_size", "pass_manager"]
