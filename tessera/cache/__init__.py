"""The persistent, content-addressed compile cache: one package, one module per concern.

``entry`` (entries, atomic writes, locks), ``index`` (the one ``(size, piece, compiler)``
schema, read and merged), ``key`` (one ``KeyRecord`` per kind of key, one hasher), ``artifact``
(whole-model artifact), ``explain`` (why a miss) and ``tools`` (ls / verify / clear / prune).
"""

from __future__ import annotations

from tessera.cache.entry import CacheDamagedWarning, cache_root

__all__ = ["CacheDamagedWarning", "cache_root"]
