"""A compile worker: a process of its own that compiles one piece at one static size per job.

Started by ``compile_pool.CompilePool`` as ``python -c "...compile_worker import main; main()"`` (so
that the records it pickles are this module's, not ``__main__``'s). Jobs arrive on stdin
and results leave on the original stdout, each a length-prefixed pickle; everything the compile
itself prints goes to stderr. The worker writes the piece file into the cache entry exactly as an
in-process compile would (``InductorCompiler.compile``), and the parent loads it from there: the
cache holds the same bytes whichever process compiled.

Only static sizes are sent here: their example inputs are plain shapes (``TensorSpec``), while a
general or range compile needs the trace's symbolic shapes, which do not cross a process boundary.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time
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
    """One piece to compile at one static size, and where its piece file goes."""

    graph: torch.fx.GraphModule
    inputs: tuple[Any, ...]  # TensorSpec for each tensor, the value itself otherwise
    config: Any  # CompileConfig (typed loosely: this module is imported without tessera.config)
    size: int
    key: str  # the piece file's name in the entry (the artifact cache's scratch name)
    cache_dir: str
    machine_record: str | None
    roots: tuple[str, ...] = ()  # the parent's cache roots: the worker's writer lock goes there
    env: dict[str, str] = field(default_factory=dict)
    state: Any = None  # the traced call's CompileState: the compile runs under it (None: as is)


@dataclass(frozen=True)
class JobDone:
    """A compiled piece: its file's name in the entry (None: not saved), time and counters."""

    handle: str | None
    seconds: float
    counts: dict[str, int]
    pid: int


@dataclass(frozen=True)
class JobFailed:
    """A compile that raised in the worker; the parent compiles the piece itself."""

    error: str


def read_message(stream: IO[bytes]) -> Any | None:
    """One length-prefixed pickle from ``stream``; None at its end (the other side closed it)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (length,) = _HEADER.unpack(header)
    payload = stream.read(length)
    if len(payload) < length:
        return None
    return pickle.loads(payload)  # our own parent (or worker), on a pipe private to the two


def write_message(stream: IO[bytes], payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def example_inputs(specs: tuple[Any, ...]) -> list[Any]:
    """Tensors of each spec's layout (zeros: a static compile reads shapes, never values)."""
    return [
        torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=spec.device).zero_()
        if isinstance(spec, TensorSpec)
        else spec
        for spec in specs
    ]


def run(job: PieceJob) -> JobDone:
    """Compile ``job`` as the parent would have, into the entry's directory."""
    import contextlib
    from pathlib import Path

    from tessera import counters
    from tessera.cache import liveness
    from tessera.compilers import InductorCompiler

    for name in CACHE_ENV:
        if name in job.env:
            os.environ[name] = job.env[name]
    for root in job.roots:
        liveness.register_root(Path(root))
    start = time.perf_counter()
    before = counters.snapshot()
    compiler = InductorCompiler()
    compiler.initialize_cache(Path(job.cache_dir))
    compiler.machine_record = Path(job.machine_record) if job.machine_record else None
    with job.state.applied() if job.state is not None else contextlib.nullcontext():
        _, handle = compiler.compile(job.graph, example_inputs(job.inputs), job.config, job.size, job.key)
    after = counters.snapshot()
    counts = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    return JobDone(handle, time.perf_counter() - start, counts, os.getpid())


def main() -> None:
    """Serve jobs until stdin closes."""
    jobs = sys.stdin.buffer
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the compile prints must not corrupt the result stream
    # Inductor's imports, before the first job arrives (they overlap with the parent's trace).
    from tessera import _compat

    _compat.preload_inductor()
    write_message(results, pickle.dumps(READY))
    while True:
        job = read_message(jobs)
        if job is None:
            return
        try:
            result: JobDone | JobFailed = run(job)
        except Exception as e:  # the parent falls back to compiling in its own process
            result = JobFailed(f"{type(e).__name__}: {e}")
        write_message(results, pickle.dumps(result))
