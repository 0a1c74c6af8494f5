"""What a compile worker and its parent exchange: the job, its result, and the pipe they cross.

A job is one piece at one static size or at the general one (``PieceJob``). A static size's
example inputs cross as plain shapes (``TensorSpec``); the general one's as the trace's symbolic
shapes, described (symbolic_inputs.py) and made again in the worker. A shape (one static value per
dynamic size) crosses as a static size does. Ranges compile in the parent. Each message is a
length-prefixed pickle (``read_message`` / ``write_message``). The worker itself is
``compile_worker.py``; the pool that feeds it, ``compile_pool.py``.
"""

from __future__ import annotations

import dataclasses
import pickle
import struct
from dataclasses import dataclass, field
from typing import IO, Any

import torch

# The environment a job's compile reads its Inductor cache location from: the parent's at the time
# of the job (a test, or a caller, may point it elsewhere after the worker started).
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
_HEADER = struct.Struct(">Q")
# The worker's first message, once it has imported what a compile needs: the parent knows it
# started a working worker (not, say, an embedding server's binary that sys.executable names).
READY = "tessera compile worker ready"


@dataclass(frozen=True)
class TensorSpec:
    """What a compile at a static size needs of an example tensor: its layout, not its values."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, str(tensor.device))


@dataclass(frozen=True)
class PieceJob:
    """One piece to compile at one static size or shape (or the general size: None), and where its
    piece file goes."""

    graph: torch.fx.GraphModule
    # A static size's: TensorSpec for each tensor, the value itself otherwise. The general size's:
    # a symbolic_inputs.SymbolicInputs.
    inputs: Any
    config: Any  # CompileConfig (typed loosely: this module is imported without tessera.config)
    size: Any  # an int, a config.Shape, or None (typed loosely, as config is)
    key: str  # the piece file's name in the entry (the artifact cache's scratch name)
    cache_dir: str
    machine_record: str | None
    roots: tuple[str, ...] = ()  # the parent's cache roots: the worker's writer lock goes there
    env: dict[str, str] = field(default_factory=dict)
    state: Any = None  # the traced call's CompileState: the compile runs under it (None: as is)

    def __reduce__(self) -> tuple[Any, ...]:
        # Reason: a GraphModule's own pickle re-traces its code with torch.fx on load, which runs
        # each factory call whose arguments are constants (torch.tensor([]) in a Hugging Face cache,
        # a cache position's arange) and keeps its result as a buffer: the worker's graph was not
        # the piece (its fake propagation refused the real constant; an artifact compiled from it
        # took the buffers as inputs). The graph crosses as its nodes, rebuilt without a trace.
        from tessera.compilation.graph_pickle import dump_graph

        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["graph"] = dump_graph(self.graph)
        return (_received_job, (fields,))


def _received_job(fields: dict[str, Any]) -> PieceJob:
    from tessera.compilation.graph_pickle import load_graph

    return PieceJob(**{**fields, "graph": load_graph(fields["graph"])})


@dataclass(frozen=True)
class JobDone:
    """A compiled piece: its file's name in the entry (None: not saved), time and counters."""

    handle: str | None
    seconds: float
    counts: dict[str, int]
    pid: int


@dataclass(frozen=True)
class JobFailed:
    """A compile that raised in the worker; the parent compiles the piece itself. ``unloadable``:
    the job named what the worker's process does not have (an op the user's code defines, such as
    a ``torch.library.custom_op`` in their script): expected, so the parent compiles it quietly."""

    error: str
    unloadable: bool = False


def read_message(stream: IO[bytes]) -> Any | None:
    """One length-prefixed pickle from ``stream``; None at its end (the other side closed it)."""
    payload = read_payload(stream)
    return None if payload is None else pickle.loads(payload)  # our parent or worker, on a private pipe


def read_payload(stream: IO[bytes]) -> bytes | None:
    """One length-prefixed message's bytes from ``stream``; None at its end."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        return None
    return payload


def write_message(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def example_inputs(graph: torch.fx.GraphModule, specs: Any) -> list[Any]:
    """A job's example inputs: for a static size, tensors of each spec's layout (zeros: a static
    compile reads shapes, never values); for the general size, fake tensors with the trace's
    symbolic sizes, which ``graph``'s nodes then carry too (symbolic_inputs.rebuild)."""
    from tessera.compilation.symbolic_inputs import SymbolicInputs, rebuild

    if isinstance(specs, SymbolicInputs):
        return rebuild(specs, graph)
    return [
        torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=spec.device).zero_()
        if isinstance(spec, TensorSpec)
        else spec
        for spec in specs
    ]
