"""``Refused``: why one part of a warm start cannot be used this time, as a value.

Every step of the Dynamo-free start (the pointer, the cache entry, the whole-model artifact, its
bytecode, each piece's artifact) returns what it found or a ``Refused``; the caller chooses between
the warm load and a trace by looking at the value, never by catching an exception.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refused:
    """The reason a step of the warm start declined (the caller traces instead)."""

    reason: str

    def __str__(self) -> str:
        return self.reason
