"""Where a compiled model is in its life, and what serves its calls: one record, swapped whole."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tessera.trace import call_check


class Stage(enum.Enum):
    """Where a compiled model is in its life (``compiled.stage``)."""

    UNBUILT = "unbuilt"  # no trace yet
    TRACING = "tracing"  # the first call is loading or tracing and compiling
    EAGER = "eager"  # calls are served eagerly while the first trace is made beside them (beside.py)
    READY = "ready"  # calls go through the traces' checks (traces.py)


@dataclasses.dataclass(frozen=True)
class Lifecycle:
    """Where a compiled model is in its life and what serves its calls, replaced whole at each
    transition (a reader sees one consistent record, never half of two)."""

    stage: Stage
    call: Callable[..., Any]  # what ``compiled(...)`` runs: root hooks, the check, the forward
    spec: call_check.CallSpec | None = None  # what the trace serving last assumed of a call
