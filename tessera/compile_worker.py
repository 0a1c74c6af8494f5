"""A compile worker: a process of its own that compiles one piece at one size per job.

Started by ``compile_pool.CompilePool`` as ``python -c "...compile_worker import main; main()"``.
Jobs arrive on stdin and results leave on the original stdout, as ``compile_jobs.py`` frames them;
everything the compile itself prints goes to stderr. The worker writes the piece file into the cache
entry exactly as an in-process compile would (``InductorCompiler.compile``), and the parent loads it
from there: the cache holds the same bytes whichever process compiled.

Static sizes and general ones are sent here (see compile_jobs.py).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.compile_jobs import JobDone, JobFailed, PieceJob


def run(job: PieceJob) -> JobDone:
    """Compile ``job`` as the parent would have, into the entry's directory."""
    import contextlib
    from pathlib import Path

    from tessera import counters
    from tessera.cache import liveness
    from tessera.compile_jobs import CACHE_ENV, JobDone, example_inputs
    from tessera.inductor_compiler import InductorCompiler

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
        inputs = example_inputs(job.graph, job.inputs)
        _, handle = compiler.compile(job.graph, inputs, job.config, job.size, job.key)
    after = counters.snapshot()
    counts = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    return JobDone(handle, time.perf_counter() - start, counts, os.getpid())


def _own_group() -> None:
    """Put this worker, and the C++ compilers it starts, in a process group of their own, in the
    parent's session: the parent stops the group while it serves a call (worker_pause.py), and a
    group left stopped by a parent that died is continued and hung up by the kernel (an orphaned
    process group), which ends it: SIGHUP is put back to its default here, since a server started
    under ``nohup`` passes its ignoring on to every process it starts (a worker that ignored it was
    continued and went on, in CI). Being in a group of its own, the worker gets no hangup of the
    terminal's (the foreground group's). Writes to the terminal from a group not in its foreground
    would stop the worker where the terminal says so (``stty tostop``): ignored, they are written."""
    import contextlib
    import signal

    if hasattr(os, "setpgid"):
        with contextlib.suppress(OSError):  # a sandbox that forbids it: stopped alone, its compilers run on
            os.setpgid(0, 0)
    if hasattr(signal, "SIGTTOU"):
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_DFL)


def main() -> None:
    """Serve jobs until stdin closes."""
    _own_group()
    jobs = sys.stdin.buffer
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the imports and the compile print must not corrupt the result stream
    from tessera.priority import lower_process

    # Before torch's import (seconds of CPU): the pool sets it (compile_pool._worker_env), and a
    # worker competes with the parent's served calls from its start.
    lower_process(os.environ.get("TESSERA_BACKGROUND_PRIORITY", "low"))
    from tessera import _compat
    from tessera.compile_jobs import READY, JobFailed, read_message, write_message

    # Inductor's imports, before the first job arrives (they overlap with the parent's trace).
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
