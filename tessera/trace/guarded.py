"""The guarded path: a model Dynamo cannot trace as one graph (a graph break) runs as
``torch.compile`` would, Dynamo's guards and re-compiles kept, each graph split, compiled per size
and cached by tessera (receiver.py, guarded). The model's traces (traces.py) hold no entry for it:
Dynamo's cache is the home of its graphs, and the model's report lists them."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from tessera import _compat
from tessera.cache import pointer
from tessera.config import CompileConfig
from tessera.errors import TesseraWarning
from tessera.report import GuardedGraph
from tessera.trace import hooks
from tessera.trace.grad import as_inference, grad_tensors
from tessera.trace.trace_entry import TraceContext
from tessera.trace.wrapper import DynamicChoice, entry_frame, mark_dynamic

log = logging.getLogger(__name__)


def start_guarded(
    name: str,
    config: CompileConfig,
    prefix: str,
    target: Callable[..., Any],
    module: torch.nn.Module | None,
    call: tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]],
    choice: DynamicChoice,
    reason: str,
    graphs: list[GuardedGraph],
) -> tuple[Any, Callable[..., Any], float]:
    """Run the first call ``(args, kwargs, bound values)`` through Dynamo with tessera compiling
    each graph (appended to ``graphs``); the output, the call for later calls, and the seconds it
    took. Said once, naming every break and its line."""
    from tessera.trace.receiver import GraphReceiver

    args, kwargs, values = call
    compiler = GraphReceiver.for_guarded_path(
        config, prefix, lambda record, split_model: graphs.append(GuardedGraph(record, split_model))
    )
    # A frame of our own: Dynamo's cache and guards for it are this model's alone.
    compiled = torch.compile(entry_frame(), backend=compiler, dynamic=None)

    def run(*args: Any, **kwargs: Any) -> Any:
        # As the one-graph path: refused, or run as inference.
        return as_inference(
            name, module, lambda: grad_tensors((args, kwargs)), lambda: compiled(target, *args, **kwargs)
        )

    served = hooks.around(module, run)

    marked = [v for v in values.values() if isinstance(v, torch.Tensor)]
    start = time.perf_counter()
    compiler.mark_outputs = True  # the frames after a break traced with the same dims dynamic
    try:
        with _compat.dim_marks_restored(marked):
            mark_dynamic(values, DynamicChoice(choice.dims, True))  # "maybe": Dynamo may keep one static
            output = run(*args, **kwargs)
    finally:
        compiler.mark_outputs = False
        _compat.clear_dim_marks(compiler.marked)
        compiler.marked.clear()
    seconds = time.perf_counter() - start
    breaks = [f"{r.source}: {r.reason}" for r, _ in graphs if r.graph_break]
    warnings.warn(
        f"{name} has graph breaks, so tessera runs it as torch.compile would: "
        f"{len(graphs)} graph(s), each compiled and cached by tessera, Dynamo's guards kept. "
        f"Breaks: {'; '.join(breaks) or reason}. Remove them for one graph "
        "without guards, or pass fullgraph=True to refuse such models",
        TesseraWarning,
        stacklevel=5,
    )
    return output, served, seconds


def record_guarded(context: TraceContext | None, name: str, reason: str) -> None:
    """Tell the next process this model takes the guarded path (no one-graph trace to fail)."""
    if context is None or context.root is None or context.fingerprint is None:
        return
    try:
        pointer.write_path(context.root, context.fingerprint, "guarded", reason)
    except OSError as e:  # a read-only cache: the next process fails the one-graph trace too
        log.debug("%s: path not recorded (%s)", name, e)
