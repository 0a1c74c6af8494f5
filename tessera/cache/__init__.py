"""The persistent, content-addressed compile cache: one package, one module per concern.

``entry`` (entries, atomic writes, locks), ``index`` (the one ``(size, piece, compiler)``
schema, read and merged), ``key`` (one ``KeyRecord`` per kind of key, one hasher), ``artifact``
(whole-model artifact), ``explain`` (why a miss) and ``tools`` (ls / verify / clear / prune).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["CacheDamagedWarning", "cache_root"]

if TYPE_CHECKING:
    from tessera.cache.entry import CacheDamagedWarning, cache_root


def __getattr__(name: str) -> Any:
    # Imported when first read: a module of the package (root.py) is then had without the
    # entries' machinery (locks, the index), which a first call served eagerly does not need.
    if name in __all__:
        from tessera.cache import entry

        return getattr(entry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
