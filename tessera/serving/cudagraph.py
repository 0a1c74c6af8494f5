"""CUDA graphs per compiled piece: warm up, capture into a shared pool, replay; pad sizes up.

State per capture size is explicit (warm-up → captured → replay). The graph mechanics sit behind
``GraphPool`` so that padding and buffer logic run (and are tested) on machines without CUDA.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from tessera import counters
from tessera.compilation.piece import DynamicInputs, SizeSource
from tessera.errors import TesseraError
from tessera.serving.learn import SizeTally

log = logging.getLogger(__name__)

WARMUP_RUNS = 1
# Decode batch sizes: every size to 8, then steps of 8 (vLLM-like serving shapes).
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 129, 8), 160, 192, 224, 256)


class CUDAGraphError(TesseraError):
    """A CUDA graph was replayed with inputs it was not captured with."""


def padded_size(size: int, capture_sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= ``size`` (sorted ``capture_sizes``), or None above the largest."""
    at = bisect.bisect_left(capture_sizes, size)
    return capture_sizes[at] if at < len(capture_sizes) else None


class GraphPool(Protocol):
    """Records ``fn(*static_args)`` once and replays it; CUDA in production, a stand-in in tests."""

    def capture(self, fn: Callable[[], Any], first: bool) -> tuple[Any, Any]:
        """Run capture of ``fn``; return (graph handle, the static outputs)."""
        ...

    def replay(self, graph: Any) -> None: ...


class CUDAGraphPool:
    """torch.cuda.CUDAGraph capture into one memory pool shared by every piece and size."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], Any], first: bool) -> tuple[Any, Any]:
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph() runs gc.collect() and empty_cache() before every capture: seconds
        # over hundreds of pieces. Only the first capture of a model needs them (torch <= 2.13).
        with contextlib.ExitStack() as stack:
            if not first:
                stack.enter_context(_suppressed_gc_and_empty_cache())
            stack.enter_context(torch.cuda.graph(graph, pool=self.pool))
            outputs = fn()
        return graph, outputs

    def replay(self, graph: Any) -> None:
        graph.replay()


@contextlib.contextmanager
def _suppressed_gc_and_empty_cache() -> Iterator[None]:
    saved = gc.collect, torch.cuda.empty_cache
    gc.collect = lambda generation=2: 0  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda: None
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = saved


@dataclass
class _Captured:
    graph: Any = None
    static_args: list[Any] = field(default_factory=list)
    outputs: Any = None
    warmups: int = 0
    addresses: tuple[int, ...] = ()
    label: str = ""  # the artifact captured, as the size tally names it ("size 8 (graph)")


class CUDAGraphPiece:
    """One compiled piece under CUDA graphs: a graph per capture size, inputs padded up to it."""

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        size_source: SizeSource,
        dynamic: DynamicInputs,
        capture_sizes: Sequence[int],
        pool: GraphPool,
        *,
        first: bool,
        debug: bool = False,
    ) -> None:
        self.name = name
        self.fn = fn
        self.source = size_source
        self.dynamic = dynamic
        self.capture_sizes = tuple(sorted(capture_sizes))
        self.pool = pool
        self.first = first
        self.debug = debug
        self.states: dict[int, _Captured] = {}
        # The model's size tally when this piece's runner holds it: a replay does not call the
        # runner, so the replayed calls are counted here (under the artifact captured).
        self.tally: SizeTally | None = None

    def add_capture_size(self, size: int) -> None:
        """A size learnt from traffic: captured at its next call (calls pad up to it)."""
        self.capture_sizes = tuple(sorted({*self.capture_sizes, size}))

    def remove_capture_size(self, size: int) -> None:
        """A learnt size retired: its graph let go (calls pad to the next capture size)."""
        self.capture_sizes = tuple(s for s in self.capture_sizes if s != size)
        self.states.pop(size, None)

    def __call__(self, *args: Any) -> Any:
        size = self.source.read(args)
        padded = padded_size(size, self.capture_sizes)
        if padded is None:  # above the largest capture size: no graph
            return self.fn(*args)
        state = self.states.setdefault(padded, _Captured())
        if state.graph is None:
            if state.warmups < WARMUP_RUNS:
                state.warmups += 1
                return self.fn(*args)  # warm-up: also the real result of this call
            self._capture(state, padded, args)
        self._fill(state, args, size)
        self.pool.replay(state.graph)
        if self.tally is not None:
            self.tally.seen(size, state.label)
        return self._slice(state.outputs, size, padded)

    def _capture(self, state: _Captured, padded: int, args: Sequence[Any]) -> None:
        state.static_args = [self._static(i, a, padded) for i, a in enumerate(args)]
        state.addresses = self._addresses(state.static_args)
        # Real inputs go in before capture too: a capture that executes (the CPU stand-in, or a
        # future backend) then computes exactly what the replay of this call will.
        self._fill(state, args, self.source.read(args))
        first = self.first and not any(s.graph is not None for s in self.states.values())
        artifact_for = getattr(self.fn, "artifact_for", None)
        state.label = f"{artifact_for(padded) if artifact_for else 'general'} (graph)"
        state.graph, state.outputs = self.pool.capture(lambda: self.fn(*state.static_args), first)
        counters.bump("cudagraphs_captured")
        log.debug("%s: captured CUDA graph for size %d", self.name, padded)

    def _static(self, index: int, arg: Any, padded: int) -> Any:
        if index in self.dynamic.symint_positions:
            return padded
        dim = self.dynamic.tensor_dims[index] if index < len(self.dynamic.tensor_dims) else None
        if dim is None or not isinstance(arg, torch.Tensor):
            return arg  # weights and other fixed inputs are captured by address
        shape = list(arg.shape)
        shape[dim] = padded
        return torch.zeros(shape, dtype=arg.dtype, device=arg.device)

    def _fill(self, state: _Captured, args: Sequence[Any], size: int) -> None:
        """Copy the inputs that follow the size into the static buffers (copy-and-call)."""
        for index, (arg, static) in enumerate(zip(args, state.static_args, strict=True)):
            dim = self.dynamic.tensor_dims[index] if index < len(self.dynamic.tensor_dims) else None
            if dim is not None and isinstance(arg, torch.Tensor):
                static.narrow(dim, 0, size).copy_(arg)
        if self.debug:
            got = self._addresses(args)
            fixed = [i for i, d in enumerate(self.dynamic.tensor_dims) if d is None]
            moved = [i for i in fixed if i < len(got) and got[i] != state.addresses[i]]
            if moved:
                raise CUDAGraphError(
                    f"{self.name}: inputs {moved} are not at the addresses captured "
                    f"({[hex(state.addresses[i]) for i in moved]} expected, {[hex(got[i]) for i in moved]} "
                    "found); a fixed input (weight, buffer) was replaced after capture"
                )

    @staticmethod
    def _addresses(args: Sequence[Any]) -> tuple[int, ...]:
        return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else 0 for a in args)

    def _slice(self, outputs: Any, size: int, padded: int) -> Any:
        if size == padded:
            return outputs
        if isinstance(outputs, torch.Tensor):
            dim = self.dynamic.output_dims[0] if self.dynamic.output_dims else None
            return outputs if dim is None else outputs.narrow(dim, 0, size)
        sliced = []
        for out, dim in zip(outputs, self.dynamic.output_dims, strict=False):
            sliced.append(
                out.narrow(dim, 0, size) if dim is not None and isinstance(out, torch.Tensor) else out
            )
        return type(outputs)(sliced) if isinstance(outputs, tuple) else sliced


def resolve_capture_sizes(configured: Sequence[int] | None, max_size: int | None) -> tuple[int, ...]:
    sizes = tuple(configured) if configured is not None else DEFAULT_CAPTURE_SIZES
    return tuple(s for s in sizes if max_size is None or s <= max_size)


def cuda_graphs_available(mode: str) -> bool:
    """Whether ``cudagraph_mode`` can take effect here; warns once when it cannot."""
    if mode == "none":
        return False
    if torch.cuda.is_available():
        return True
    if not _warned:
        _warned.append(True)
        log.warning("cudagraph_mode=%r needs CUDA, which this machine lacks: running without graphs", mode)
    return False


_warned: list[bool] = []
