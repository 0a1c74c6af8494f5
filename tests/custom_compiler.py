"""User-defined compilers for the ``module:Class`` backend tests (and a cache test compiler)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from tessera.cache.entry import atomic_write


class CountingCompiler:
    name = "counting"
    compiled: ClassVar[list[Any]] = []

    def compute_hash(self) -> str:
        return "counting-v1"

    def initialize_cache(self, cache_dir: Any) -> None:
        pass

    def compile(self, graph, example_inputs, config, size, key):
        CountingCompiler.compiled.append(size)
        return graph.forward, None

    def load(self, handle, graph, example_inputs, index, size):
        return graph.forward


class PerturbingCompiler:
    """A wrong compiler, for bisection tests: piece 2 comes out off by 0.1; the others are right."""

    name = "perturbing"

    def compute_hash(self) -> str:
        return "perturbing-v1"

    def initialize_cache(self, cache_dir: Any) -> None:
        pass

    def compile(self, graph, example_inputs, config, size, key):
        if "piece2_" not in key:  # the scratch name says which piece (see artifact_cache.py)
            return graph.forward, None

        def wrong(*args):
            out = graph.forward(*args)
            if isinstance(out, tuple):
                return tuple(o + 0.1 if o.is_floating_point() else o for o in out)
            return out + 0.1

        return wrong, None

    def load(self, handle, graph, example_inputs, index, size):
        raise AssertionError("nothing is saved, so nothing is loaded")


class SavingCompiler:
    """Runs graphs and saves each artifact as a small file, so that a warm process loads them.

    ``load_fails_with``: an exception ``load`` raises (a loader bug, or the compiler's own report
    that the file's bytes are not an artifact).
    """

    name = "saving"
    load_fails_with: ClassVar[BaseException | None] = None
    loads: ClassVar[int] = 0

    def compute_hash(self) -> str:
        return "saving-v1"

    def initialize_cache(self, cache_dir: Any) -> None:
        self.cache_dir = cache_dir

    def compile(self, graph, example_inputs, config, size, key):
        if self.cache_dir is None:
            return graph.forward, None
        (self.cache_dir / key).parent.mkdir(parents=True, exist_ok=True)
        (self.cache_dir / key).write_bytes(b"saving-compiler artifact v1")
        return graph.forward, key

    def load(self, handle, graph, example_inputs, index, size):
        SavingCompiler.loads += 1
        if SavingCompiler.load_fails_with is not None:
            raise SavingCompiler.load_fails_with
        return graph.forward


class CodeSavingCompiler:
    """Runs graphs as Python, like the eager compiler, but saves one artifact file per piece (its
    graph's code) and reads it back on load: cache tests get real files on disk (scratch files,
    checksums, loads that can fail) without the cost of Inductor."""

    name = "code-saving"

    def __init__(self) -> None:
        self.cache_dir: Path | None = None

    def compute_hash(self) -> str:
        return "code-saving-v1"

    def initialize_cache(self, cache_dir: Path | None) -> None:
        self.cache_dir = cache_dir

    def compile(self, graph, example_inputs, config, size, key):
        if self.cache_dir is None:
            return graph.forward, None
        atomic_write(self.cache_dir / key, graph.code.encode())
        return graph.forward, key

    def load(self, handle, graph, example_inputs, index, size):
        assert self.cache_dir is not None, "load() needs initialize_cache(dir) first"
        if (self.cache_dir / handle).read_text() != graph.code:
            raise ValueError(f"{handle} holds another graph's code")
        return graph.forward


class PriorityRecordingCompiler:
    """Records, per compile, the compiling thread's name, its CPU priority (nice, scheduling
    policy) and the nice of a process it starts (as Inductor's C++ compiler would be)."""

    name = "priority-recording"
    seen: ClassVar[list[dict[str, Any]]] = []

    def compute_hash(self) -> str:
        return "priority-recording-v1"

    def initialize_cache(self, cache_dir: Any) -> None:
        pass

    def compile(self, graph, example_inputs, config, size, key):
        import os
        import subprocess
        import threading

        child = subprocess.run(["nice"], capture_output=True, text=True, check=True).stdout
        PriorityRecordingCompiler.seen.append(
            {
                "thread": threading.current_thread().name,
                "nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                "policy": os.sched_getscheduler(0),
                "child_nice": int(child),
            }
        )
        return graph.forward, None

    def load(self, handle, graph, example_inputs, index, size):
        return graph.forward


class BlockingCompiler:
    """Compiles nothing until ``release`` is set: the background compile stays running, so the
    calls served meanwhile are served beside a compile."""

    name = "blocking"
    release: ClassVar[Any] = None  # a threading.Event, set by the test

    def compute_hash(self) -> str:
        return "blocking-v1"

    def initialize_cache(self, cache_dir: Any) -> None:
        pass

    def compile(self, graph, example_inputs, config, size, key):
        assert BlockingCompiler.release is not None and BlockingCompiler.release.wait(120)
        return graph.forward, None

    def load(self, handle, graph, example_inputs, index, size):
        return graph.forward
