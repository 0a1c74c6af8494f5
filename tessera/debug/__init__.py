"""Finding what went wrong: debug dumps of every stage, and numerical bisection piece by piece.

``bisect(model, compiled, *args, **kwargs)`` runs eager and compiled side by side and names the
first piece whose error exceeds a tolerance; ``dumps`` writes what each stage produced.
"""

from __future__ import annotations

from tessera.debug.bisect import BisectReport, PieceError, bisect

__all__ = ["BisectReport", "PieceError", "bisect"]
