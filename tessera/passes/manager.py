"""The one post-grad pass Inductor is handed: it runs every configured pass, in order, and tells
each the size or range being compiled (``compiling_size()``)."""

from __future__ import annotations

import contextvars
import hashlib
import logging
import uuid
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch.fx

from tessera import _compat
from tessera.config import Size, size_label

log = logging.getLogger(__name__)

_SIZE: contextvars.ContextVar[Size] = contextvars.ContextVar("tessera_compiling_size", default=None)


@runtime_checkable
class Pass(Protocol):
    """A post-grad graph rewrite; ``uuid()`` names its version for the cache key."""

    def __call__(self, graph: torch.fx.Graph) -> None: ...

    def uuid(self) -> str: ...


def compiling_size() -> Size:
    """The size being compiled while a pass runs: None (general), an int, or a ``SizeRange``."""
    return _SIZE.get()


def pass_manager(passes: Sequence[Any], size: Size) -> Any:
    """Inductor's ``post_grad_custom_post_pass`` for one compile: runs ``passes`` at ``size``.

    Built on Inductor's ``CustomGraphPass`` (torch 2.11-2.13), whose ``uuid()`` enters Inductor's
    FX graph cache key. Ours is new for every compile: a hit in Inductor's cache (an earlier
    process, the same graph) would return its output without running the passes, and a pass is
    promised a call per compile (it may count, log or check). Turning that cache off instead would
    also stop Inductor from producing the artifact tessera saves. Which passes ran is in tessera's
    own key (each pass's ``uuid()``), so unchanged passes still start warm from tessera's cache.
    """
    base: Any = _compat.custom_graph_pass_base()
    nonce = uuid.uuid4().hex

    class PassManager(base):  # type: ignore[misc]
        def __call__(self, graph: torch.fx.Graph) -> None:
            token = _SIZE.set(size)
            try:
                for pass_ in passes:
                    applies = getattr(pass_, "applies_to", None)
                    if applies is not None and not applies(size):
                        continue
                    pass_(graph)
                    log.debug("pass %s ran at %s", type(pass_).__name__, size_label(size))
            finally:
                _SIZE.reset(token)
            graph.lint()

        def uuid(self) -> str:
            parts = [str(p.uuid()) for p in passes] + [size_label(size), nonce]
            return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    return PassManager()
