"""The intra-op threads of a call served while compiles run beside it.

A CPU op runs its parallel regions on a team of OpenMP threads, one per core by default. While a
compile runs beside the served calls, Inductor's C++ compiler takes a core, and a team as large as
the machine then waits for that core at every parallel region: the compiler is at a low priority
(priority.py), but the kernel lets it finish its slice before a woken team thread runs. Measured
on the 2-core CPU over the first minute after a cold start (``python -m benchmarks.first_minute``,
docs/serving.md): the 99th percentile of the toy Llama's calls (4 layers) over eager's median fell
from 13.3x to 2.1x with the team one thread smaller beside a compile (eager's own: 1.9x).

So while compiles run, a call served by a trace runs its parallel regions on one thread fewer per
compile (at least one), and its thread's count is put back when it returns. OpenMP's count is per
thread: other threads, and the compiles' own, keep theirs. Calls served eagerly keep theirs: their
numbers are eager's own, and a different team size can move a reduction's last bits; a traced or
compiled call's numbers are eager's within tolerance anyway. Inductor kernels whose thread count
is written into them (``config.cpp.threads`` set) and BLAS calls keep their own counts.
"""

from __future__ import annotations

import torch

from tessera import _compat


def leave_cores(compiles: int) -> int | None:
    """Run this thread's parallel regions on ``compiles`` threads fewer (at least one). Returns the
    count to give ``put_back`` after the call, or None where nothing changed (one thread already,
    or no OpenMP runtime)."""
    runtime = _compat.openmp_runtime()
    if runtime is None:
        return None
    # torch.get_num_threads also runs torch's set-up of this thread's count (the first time in a
    # thread), which would otherwise reset the count set here at the call's first parallel op.
    full = torch.get_num_threads()
    fewer = max(1, full - compiles)
    if fewer >= full:
        return None
    runtime.set_threads(fewer)
    return full


def put_back(full: int) -> None:
    """Put this thread's count back to what ``leave_cores`` returned."""
    runtime = _compat.openmp_runtime()
    if runtime is not None:
        runtime.set_threads(full)
