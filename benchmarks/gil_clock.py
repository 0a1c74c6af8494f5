"""A clock of the time a thread waits for the GIL, for ``benchmarks/first_minute.py --gil-clock``.

A served call that is slow either waited for the GIL (another thread held it: a background trace's
C call, a collection) or ran slowly on its core (the core taken, its caches shared). The two call
for different remedies, and the time alone cannot tell them apart. CPython 3.10-3.13 waits for the
GIL in ``pthread_cond_timedwait`` (``Python/ceval_gil.h``), and its locks, ``threading`` and
``time.sleep`` use semaphores and ``clock_nanosleep`` instead: so a small library, preloaded
(``LD_PRELOAD``), times every ``pthread_cond_timedwait`` and adds it to a per-thread total, which
the process reads through ``ctypes``. With one intra-op thread (``--threads 1``) torch waits on no
condition variable of its own in a served call, so the total is the GIL's. Linux and glibc only;
built with the C compiler Inductor uses anyway.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <time.h>

typedef int (*timedwait_fn)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
static timedwait_fn real_timedwait;
static __thread unsigned long long waited_ns;

int pthread_cond_timedwait(pthread_cond_t *cond, pthread_mutex_t *mutex, const struct timespec *until) {
    if (!real_timedwait)
        real_timedwait = (timedwait_fn)dlvsym(RTLD_NEXT, "pthread_cond_timedwait", "GLIBC_2.3.2");
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    int result = real_timedwait(cond, mutex, until);
    clock_gettime(CLOCK_MONOTONIC, &end);
    waited_ns += (unsigned long long)(end.tv_sec - start.tv_sec) * 1000000000ULL
                 + (end.tv_nsec - start.tv_nsec);
    return result;
}

unsigned long long tessera_gil_waited_ns(void) { return waited_ns; }
"""


def build(directory: Path | None = None) -> Path:
    """The library, compiled into ``directory`` (a fresh temporary one by default)."""
    directory = directory or Path(tempfile.mkdtemp(prefix="tessera-gil-clock-"))
    source, library = directory / "gil_clock.c", directory / "gil_clock.so"
    source.write_text(SOURCE)
    compiler = os.environ.get("CC", "gcc")
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return library


def preload_env(library: Path) -> dict[str, str]:
    """The environment entries that preload ``library`` in a child process."""
    preloaded = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": " ".join(filter(None, [str(library), preloaded]))}


def reader() -> Callable[[], float] | None:
    """Seconds the calling thread has waited for the GIL so far, or None where the library is not
    preloaded in this process."""
    try:
        waited = ctypes.CDLL(None).tessera_gil_waited_ns
    except AttributeError:
        return None
    waited.restype, waited.argtypes = ctypes.c_ulonglong, []
    return lambda: waited() / 1e9
