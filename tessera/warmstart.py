"""Starting a compiled model from the cache without Dynamo, and recording what makes that possible.

``try_warm_start`` rebuilds from a whole-model artifact; ``record_warm_start`` writes one.
"""

from __future__ import annotations

import logging
import pickle
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tessera import artifact, counters
from tessera.backend import PiecewiseBackend
from tessera.cache import CacheEntry
from tessera.manager import CompilerManager
from tessera.piece import PieceRunner
from tessera.split import SplitItem

log = logging.getLogger(__name__)


def try_warm_start(
    backend: PiecewiseBackend,
    root: Path,
    print_: str,
    func: types.FunctionType,
    bound_to: object | None,
) -> tuple[Callable[..., Any], list[SplitItem]] | None:
    """The model's callable rebuilt from the cache, or None to take the Dynamo path.

    Damage found on the way is reported once (the Dynamo path then rebuilds it); anything else
    that stops this path (no artifact yet, a changed source file) is logged at INFO.
    """
    try:
        entry_path = artifact.read_pointer(root, print_)
        if entry_path is None:
            return None
        store = CacheEntry.open_warm(entry_path)
        if store is None:
            return None
        model = artifact.load(entry_path)
        split_gm = pickle.loads(model.split_module)
        manager = CompilerManager(backend.compiler, backend.config, store)
        for name, layout in model.layouts:
            backend.keep_layout(split_gm, name, layout)
        for record in model.pieces:
            graph = getattr(split_gm, record.name)
            artifacts = {}
            for size in artifact.piece_sizes(record):
                outcome = manager.load_only(graph, size, record.index)
                if outcome is None:
                    raise artifact.WarmStartUnavailable(f"{record.name}: an artifact is missing")
                artifacts[size] = outcome.fn
            runner = PieceRunner(record.name, artifacts, record.size_source, backend.config.max_size)
            backend.records[record.name] = record
            backend.install(split_gm, record, runner)
        call = artifact.rebuild_call(model, func, bound_to, split_gm.forward)
    except artifact.WarmStartUnavailable as e:
        log.info("start without Dynamo not possible (%s); tracing", e)
        return None
    names = sorted(
        (n for n, _ in split_gm.named_children() if n.startswith("submod_")),
        key=lambda n: int(n.rsplit("_", 1)[1]),
    )
    items = [SplitItem(n, i, n in model.splitting, getattr(split_gm, n)) for i, n in enumerate(names)]
    counters.bump("pieces", len(items))
    counters.bump("compiled_pieces", len(model.pieces))
    backend.split_gm, backend.store, backend.manager = split_gm, store, manager
    return call, items


def record_warm_start(
    backend: PiecewiseBackend,
    root: Path,
    print_: str,
    func: types.FunctionType,
    code: types.CodeType,
    items: list[SplitItem],
) -> None:
    """After a Dynamo trace: write the whole-model artifact and the fingerprint's pointer to it."""
    store, split_gm = backend.store, backend.split_gm
    if store is None or split_gm is None:
        return
    model = artifact.capture(
        code,
        func,
        split_gm,
        [backend.records[i.name] for i in items if not i.is_splitting],
        [i.name for i in items if i.is_splitting],
        backend.sources,
        backend.layouts,
    )
    if model is None:
        return
    sha, size = artifact.save(store.path, model)
    store.record_model(sha, size)
    artifact.write_pointer(root, print_, store.path)
