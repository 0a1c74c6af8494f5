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
    from tessera.compilation.compile_jobs import JobDone, JobFailed, PieceJob

PARENT_POLL_SECONDS = 0.25  # how often a worker looks whether its parent is still there


def run(job: PieceJob) -> JobDone | JobFailed:
    """Compile ``job`` as the parent would have, into the entry's directory."""
    import contextlib
    from pathlib import Path

    from tessera import counters
    from tessera.cache import liveness
    from tessera.compilation.compile_jobs import CACHE_ENV, JobDone, example_inputs
    from tessera.compilation.inductor_compiler import InductorCompiler

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
    with job.state.applied(owns_process=True) if job.state is not None else contextlib.nullcontext():
        # What the compile assumes of the sizes beyond their ranges (the trace's relations are not
        # carried here) is written into the piece file, and checked by the parent per call.
        inputs = example_inputs(job.graph, job.inputs)
        _, handle = compiler.compile(job.graph, inputs, job.config, job.size, job.key)
    after = counters.snapshot()
    counts = {name: after[name] - before[name] for name in after if after[name] != before[name]}
    return JobDone(handle, time.perf_counter() - start, counts, os.getpid())


def _own_group() -> None:
    """Put this worker, and the C++ compilers it starts, in a process group of their own, so that
    the parent ends them together (``compile_pool._kill_group``). Being in a group of its own, the
    worker gets no signal of the terminal's (Ctrl-C goes to the foreground group): it ends with
    its parent instead (``_end_with_parent``). Writes to the terminal from a group not in its
    foreground would stop the worker where the terminal says so (``stty tostop``): ignored, they
    are written."""
    import contextlib
    import signal

    if hasattr(os, "setpgid"):
        with contextlib.suppress(OSError):  # a sandbox that forbids it: ended alone
            os.setpgid(0, 0)
    if hasattr(signal, "SIGTTOU"):
        signal.signal(signal.SIGTTOU, signal.SIG_IGN)


def _end_with_parent(parent: int) -> None:
    """A thread that ends this worker, and the compilers it started, within a poll of its parent's
    end (killed, or gone without ending it): nothing of tessera's runs on, or writes to the
    parent's stderr, once the process that started it is gone."""
    import signal
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        if hasattr(os, "killpg") and os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)  # its own group: the compilers it started, and itself
        os._exit(0)

    threading.Thread(target=watch, name="tessera-worker-parent", daemon=True).start()


def main() -> None:
    """Serve jobs until stdin closes."""
    _own_group()
    parent = os.environ.get("TESSERA_PARENT_PID")
    if parent is not None and parent.isdigit():
        _end_with_parent(int(parent))
    jobs = sys.stdin.buffer
    results = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the imports and the compile print must not corrupt the result stream
    from tessera.compilation.priority import lower_process

    # Before torch's import (seconds of CPU): the pool sets it (compile_pool._worker_env), and a
    # worker competes with the parent's served calls from its start.
    lower_process(os.environ.get("TESSERA_BACKGROUND_PRIORITY", "low"))
    from tessera import _compat
    from tessera.compilation.compile_jobs import READY, JobFailed, read_payload, write_message

    # Inductor's imports, before the first job arrives (they overlap with the parent's trace).
    _compat.preload_inductor()
    write_message(results, pickle.dumps(READY))
    while True:
        payload = read_payload(jobs)
        if payload is None:
            return
        result: JobDone | JobFailed
        try:
            job = pickle.loads(payload)  # from our parent, on a pipe private to the two
        except Exception as e:  # an op or class the user's code defines, which this process lacks
            result = JobFailed(f"{type(e).__name__}: {e}", unloadable=True)
        else:
            try:
                result = run(job)
            except Exception as e:  # the parent falls back to compiling in its own process
                result = JobFailed(f"{type(e).__name__}: {e}")
        try:
            write_message(results, pickle.dumps(result))
        except BrokenPipeError:  # the parent is gone, or ended this worker: nothing to say
            os._exit(0)
