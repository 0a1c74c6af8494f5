"""Compile workers: static sizes (and, in the background, general artifacts) compiled in
processes of their own, with the same results and the same cache contents as a compile in this
process."""

from __future__ import annotations

import importlib
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import tessera
from tessera import counters
from tessera.compilation import compile_pool
from tessera.compilation.compile_jobs import JobDone, JobFailed, PieceJob, TensorSpec
from tessera.compilation.compile_pool import CompilePool, Reply
from tessera.models import toy_llama

FAKE_PID = 4242


class WorkerCompiler:
    """Runs graphs as Python, and says it compiles in workers: with ``FakePool`` the test sees
    which artifacts the backend sent to a worker and how it handles the replies."""

    name = "worker-fake"
    here: ClassVar[list[Any]] = []  # the sizes compiled in this process

    def compute_hash(self) -> str:
        return "worker-fake-v1"

    def initialize_cache(self, cache_dir: Any) -> None:
        pass

    def compile(self, graph, example_inputs, config, size, key):
        WorkerCompiler.here.append(size)
        return graph.forward, None

    def load(self, handle, graph, example_inputs, index, size):
        raise AssertionError("nothing is saved, so nothing is loaded")

    def job(self, graph, example_inputs, config, size, key):
        return PieceJob(graph, tuple(example_inputs), config, size, key, cache_dir="", machine_record=None)

    def finish(self, done: JobDone) -> tuple[Any, Any]:
        return FakePool.graphs[done.handle].forward, None


class FakePool:
    """Answers each job at once: done (the graph runs as is), or failed when ``fail`` is set."""

    fail: ClassVar[bool] = False
    started: ClassVar[bool] = False
    jobs: ClassVar[list[PieceJob]] = []
    graphs: ClassVar[dict[str, torch.fx.GraphModule]] = {}

    def start(self) -> None:
        FakePool.started = True

    def submit(self, job: PieceJob, tag: Any, replies: queue.SimpleQueue[Reply]) -> bool:
        FakePool.jobs.append(job)
        FakePool.graphs[job.key] = job.graph
        result = JobFailed("the worker died") if FakePool.fail else JobDone(job.key, 0.01, {}, FAKE_PID)
        replies.put(Reply(tag, result))
        return True


@pytest.fixture
def fake_workers(monkeypatch):
    cls = importlib.import_module("tests.test_compile_workers")
    cls.WorkerCompiler.here = []
    cls.FakePool.fail = False
    cls.FakePool.started = False
    cls.FakePool.jobs = []
    cls.FakePool.graphs = {}
    monkeypatch.setattr(
        "tessera.compilation.compile_pool.shared_pool",
        lambda count, priority: cls.FakePool() if count else None,
    )
    return cls  # the module tessera loads the compiler from (pytest may import this file apart)


def _artifacts(compiled: tessera.CompiledModel, size: str) -> list[Any]:
    return [a for a in compiled.report.artifacts if a.size == size]


@pytest.mark.parametrize("background", [True, False], ids=["background", "up-front"])
def test_static_sizes_go_to_the_workers_one_job_per_distinct_piece(fake_workers, background):
    model = toy_llama.build(num_layers=3)
    compiled = tessera.compile(
        model,
        backend="tests.test_compile_workers:WorkerCompiler",
        compile_sizes=[8],
        compile_ranges=[4],
        compile_workers=1,
        background_compile=background,
    )
    for n in (6, 8, 3, 17):  # grad enabled, as a caller's default state is
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens")
    assert compiled.wait_ready(60)
    assert fake_workers.FakePool.started  # started at the build: its index lacked every artifact
    sized = _artifacts(compiled, "size 8")
    pieces = sum(not p.is_splitting for p in compiled.pieces)
    assert len(sized) == pieces
    # Identical layers send one job; the others take its artifact as shared, as in a compile here.
    sent = [a for a in sized if a.source == "compiled"]
    assert {a.worker for a in sent} == {FAKE_PID}
    assert len([job for job in fake_workers.FakePool.jobs if job.size == 8]) == len(sent) < pieces
    assert {a.source for a in sized} == {"compiled", "shared"}
    assert 8 not in fake_workers.WorkerCompiler.here
    if background:
        # General artifacts compile in the workers too, off this process's GIL, while the pieces
        # serve as traced; one job per distinct piece, as for a size.
        assert {job.size for job in fake_workers.FakePool.jobs} == {None, 8}
        assert None not in fake_workers.WorkerCompiler.here
        general = [a for a in _artifacts(compiled, "general") if a.source == "compiled"]
        assert general and {a.worker for a in general} == {FAKE_PID}
    else:
        # Up front, the first output waits for the general artifacts: compiled here, first.
        assert {job.size for job in fake_workers.FakePool.jobs} == {8}
        assert None in fake_workers.WorkerCompiler.here
    # Ranges compile here (a range's symbolic shapes stay in this process).
    assert fake_workers.WorkerCompiler.here.count(None) < len(fake_workers.WorkerCompiler.here)
    args = toy_llama.example_inputs(8)
    torch.testing.assert_close(compiled(*args), model(*args))
    assert dict(next(p for p in compiled.pieces if not p.is_splitting).served).get("size 8", 0) >= 1


def test_a_failed_worker_is_said_once_and_the_piece_compiles_here(fake_workers, caplog):
    fake_workers.FakePool.fail = True
    model = toy_llama.build(num_layers=3)
    compiled = tessera.compile(
        model,
        backend="tests.test_compile_workers:WorkerCompiler",
        compile_sizes=[8],
        compile_workers=1,
        background_compile=True,
    )
    with caplog.at_level(logging.WARNING, logger="tessera"):
        args = toy_llama.example_inputs(5)
        torch.testing.assert_close(compiled(*args), model(*args))
        assert compiled.wait_ready(60)
    said = [r for r in caplog.records if "compile worker failed" in r.getMessage()]
    assert len(said) == 1 and "the worker died" in said[0].getMessage()
    assert compiled.report.background == "done"
    # Every job the workers failed (the general artifacts' and the size's) compiled here.
    assert sorted(fake_workers.WorkerCompiler.here, key=str) == sorted(
        (job.size for job in fake_workers.FakePool.jobs), key=str
    )
    assert fake_workers.WorkerCompiler.here.count(8) >= 1
    assert all(a.worker is None for a in compiled.report.artifacts)
    args = toy_llama.example_inputs(8)
    torch.testing.assert_close(compiled(*args), model(*args))


def test_a_learnt_size_compiles_in_the_workers_which_the_learning_starts(fake_workers):
    # Up front, no static size listed: the build starts no worker. The learning starts them at its
    # first learnt size and sends every distinct piece there, off this process's GIL.
    from tessera.serving import learn

    model = toy_llama.build(num_layers=2)
    compiled = tessera.compile(
        model,
        backend="tests.test_compile_workers:WorkerCompiler",
        compile_sizes="auto",
        compile_workers=1,
        background_compile=False,
    )
    args = toy_llama.example_inputs(5)
    for i in range(2 * learn.EVERY):  # grad enabled, as a caller's default state is
        out = compiled(*args)
        if i % 16 == 0:
            torch.testing.assert_close(out, model(*args))
    assert compiled.wait_ready(60)
    assert compiled.report.learnt_sizes == (5,)
    assert {job.size for job in fake_workers.FakePool.jobs} == {5}
    assert 5 not in fake_workers.WorkerCompiler.here  # nothing of the learnt size compiled here
    learnt = [a for a in _artifacts(compiled, "size 5") if a.source == "compiled"]
    assert learnt and {a.worker for a in learnt} == {FAKE_PID}
    torch.testing.assert_close(compiled(*args), model(*args))
    assert dict(next(p for p in compiled.pieces if not p.is_splitting).served).get("size 5", 0) >= 1


def test_no_workers_without_a_cache_or_when_asked_for_none(fake_workers):
    model = toy_llama.build(num_layers=1)
    for options in ({"compile_workers": 0}, {"disable_cache": True}):
        torch._dynamo.reset()
        compiled = tessera.compile(
            model, backend="tests.test_compile_workers:WorkerCompiler", compile_sizes=[8], **options
        )
        args = toy_llama.example_inputs(8)
        torch.testing.assert_close(compiled(*args), model(*args))
    assert fake_workers.FakePool.jobs == []


def test_compile_workers_is_checked():
    with pytest.raises(tessera.ConfigError, match="compile_workers"):
        tessera.CompileConfig(compile_workers=-1)
    with pytest.raises(tessera.ConfigError, match="compile_workers"):
        tessera.CompileConfig(compile_workers=True)  # type: ignore[arg-type]


# -- real workers (Inductor) ------------------------------------------------------------------


def _piece() -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    # Unannotated: fx puts annotations into the graph, and a string one (this file's future
    # import) does not pickle; such a piece is compiled in the parent (tested below).
    def f(x, w):  # type: ignore[no-untyped-def]
        return ((x @ w).relu() * 2 + 1,)

    graph = torch.fx.symbolic_trace(f)
    return graph, [torch.randn(8, 16), torch.randn(16, 16)]


def _code(path: Path) -> str:
    from tessera.compilation import piece_file

    piece = piece_file.PieceFile.from_bytes(path.read_bytes())
    assert piece.direct is not None
    # The AOT id is a per-process counter of Inductor's compiles, in a comment.
    return re.sub(r"# AOT ID: .*", "", piece.direct.wrapper)


@pytest.mark.inductor
def test_a_worker_writes_the_piece_file_a_compile_here_would(tmp_path):
    from tessera.compilation.compilers import InductorCompiler

    graph, inputs = _piece()
    config = tessera.CompileConfig(backend="inductor")
    here, there = tmp_path / "here", tmp_path / "there"
    for directory in (here, there):
        directory.mkdir()
    local = InductorCompiler()
    local.initialize_cache(here)
    fn, handle = local.compile(graph, inputs, config, 8, "piece.bin")
    remote = InductorCompiler()
    remote.initialize_cache(there)
    job = remote.job(graph, inputs, config, 8, "piece.bin")
    assert job is not None and isinstance(job.inputs[0], TensorSpec)
    pool = CompilePool(1)
    try:
        replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        with counters.expect(inductor_compiles=1, artifacts_saved=1, artifacts_loaded=0):
            assert pool.submit(job, "tag", replies)
            reply = replies.get(timeout=300)
            assert reply.tag == "tag" and isinstance(reply.result, JobDone), reply.result
            worker_fn, worker_handle = remote.finish(reply.result)
        assert reply.result.pid == pool.workers[0].process.pid  # type: ignore[union-attr]
        assert worker_handle == handle == "piece.bin"
        assert _code(there / worker_handle) == _code(here / handle)
        torch.testing.assert_close(worker_fn(*inputs), fn(*inputs))
        torch.testing.assert_close(tuple(worker_fn(*inputs)), tuple(graph(*inputs)))

        # A worker that died is replaced for the next job; a compile that raises is a JobFailed.
        pool.workers[0].process.kill()  # type: ignore[union-attr]
        pool.workers[0].process.wait()  # type: ignore[union-attr]
        assert pool.submit(job, "again", replies)
        assert isinstance(replies.get(timeout=300).result, JobDone)
        broken = PieceJob(
            graph, (TensorSpec((8, 3), (3, 1), torch.float32, "cpu"),) * 2, config, 8, "x", str(there), None
        )
        assert pool.submit(broken, "broken", replies)
        failed = replies.get(timeout=300)
        assert failed.tag == "broken" and isinstance(failed.result, JobFailed)
        # A job that does not pickle is not sent: the caller compiles it.
        unpicklable = PieceJob(graph, (lambda: None,), config, 8, "y", str(there), None)
        assert pool.submit(unpicklable, "no", replies) is False
    finally:
        pool.stop()
    assert all(w.process is None or w.process.poll() is not None for w in pool.workers)


@pytest.mark.inductor
def test_inductor_with_a_worker_equals_eager_and_the_next_start_loads_every_size(tmp_path):
    model = toy_llama.build(num_layers=2)
    options: dict[str, Any] = {"backend": "inductor", "compile_sizes": [8], "compile_workers": 1}
    compiled = tessera.compile(model, background_compile=True, **options)
    sizes = (6, 8, 3, 17)
    for n in sizes:
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, compiling")
    assert compiled.wait_ready(300)
    sent = [a for a in _artifacts(compiled, "size 8") if a.source == "compiled"]
    assert sent and all(a.worker is not None for a in sent)
    if sys.platform.startswith("linux"):  # a worker competes with the served calls: at nice 19
        assert {os.getpriority(os.PRIO_PROCESS, a.worker) for a in sent} == {19}
    for n in sizes:
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, ready")
    # What the worker compiled is in the cache: a warm start loads every size, compiles nothing.
    torch._dynamo.reset()
    counters.reset()
    warm = tessera.compile(model, **options)
    args = toy_llama.example_inputs(8)
    torch.testing.assert_close(warm(*args), model(*args))
    counts = counters.snapshot()
    assert counts["inductor_compiles"] == 0 and counts["graphs_traced"] == 0, counts
    assert warm.report.kind == "warm"
    assert len(_artifacts(warm, "size 8")) == sum(not p.is_splitting for p in warm.pieces)


def test_a_worker_that_does_not_start_fails_its_job_instead_of_hanging(monkeypatch):
    # Embedded interpreters (a server's binary as sys.executable) start no Python: the job fails,
    # and the caller compiles the piece itself.
    monkeypatch.setattr("sys.executable", "/bin/true")
    result, _ = _one_job()
    assert isinstance(result, JobFailed) and "did not start" in result.error


def _one_job() -> tuple[Any, Any]:
    """One job through a pool of one worker: the worker's answer, and its process after it."""
    pool = CompilePool(1)
    try:
        graph, _ = _piece()
        job = PieceJob(graph, (), tessera.CompileConfig(), 8, "x", "", None)
        replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        assert pool.submit(job, "tag", replies)
        return replies.get(timeout=120).result, pool.workers[0].process
    finally:
        pool.stop()


def test_a_worker_that_hangs_on_a_job_is_stopped_and_the_job_fails(monkeypatch, tmp_path):
    # A compiler stuck for good (a deadlock, a C++ compile that never ends): past the job's
    # deadline the worker is stopped and the job fails, so the caller compiles the piece itself
    # and a new worker takes the next job; nothing waits forever.
    from tessera.compilation import compile_pool

    hangs = tmp_path / "hangs"  # says READY as a worker does, then never answers
    ready = f"import pickle, struct, sys, time; p = pickle.dumps({compile_pool.READY!r}); "
    ready += "sys.stdout.buffer.write(struct.pack('>Q', len(p)) + p); sys.stdout.buffer.flush(); "
    ready += "time.sleep(600)"
    hangs.write_text(f'#!/bin/sh\nexec {sys.executable} -c "{ready}"\n')
    hangs.chmod(0o755)
    monkeypatch.setattr("sys.executable", str(hangs))
    monkeypatch.setattr(compile_pool, "JOB_SECONDS", 2.0)
    result, process = _one_job()
    assert isinstance(result, JobFailed), result
    assert "did not finish its job within 2s" in result.error
    assert process is not None and process.poll() is not None  # stopped, not left hanging


def test_a_forked_child_starts_its_own_pool(monkeypatch):
    from tessera.compilation import compile_pool

    monkeypatch.setitem(compile_pool._pools, "shared", object())  # type: ignore[arg-type]
    pid = os.fork()
    if pid == 0:  # the child: the parent's pool has no threads here, so it must be forgotten
        os._exit(0 if "shared" not in compile_pool._pools else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "shared" in compile_pool._pools  # the parent keeps its own


class _BatchByLength(torch.nn.Module):
    """Two dynamic sizes whose piece sees their product (BERT's rows): ``b * n`` in its shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        return self.proj(x.reshape(b * n, d)).relu().reshape(b, n, d) + x.mean(1, keepdim=True)


@pytest.mark.inductor
def test_a_general_compile_in_a_worker_serves_every_shape_and_the_next_start_loads_it():
    model = _BatchByLength().requires_grad_(False)  # an inference model; grad stays enabled
    compiled = tessera.compile(model, backend="inductor", compile_workers=1, background_compile=True)
    shapes = [(2, 3), (3, 5), (4, 2)]
    for b, n in shapes:  # grad enabled: a caller's default state
        x = torch.randn(b, n, 8)
        torch.testing.assert_close(compiled(x), model(x), msg=f"{b}x{n}, compiling")
    assert compiled.wait_ready(300)
    general = [a for a in _artifacts(compiled, "general") if a.source == "compiled"]
    # The general artifact was compiled in the worker, from the trace's symbolic shapes made again.
    assert general and all(a.worker is not None and a.worker != os.getpid() for a in general)
    for b, n in [*shapes, (5, 9), (1, 6), (7, 1)]:  # sizes the first calls did not have
        x = torch.randn(b, n, 8)
        torch.testing.assert_close(compiled(x), model(x), msg=f"{b}x{n}, ready")
    assert compiled.wait_ready(300)  # a size of 1 may have been traced again: its compiles done
    torch._dynamo.reset()
    counters.reset()
    warm = tessera.compile(model, backend="inductor", compile_workers=1)
    x = torch.randn(6, 4, 8)
    torch.testing.assert_close(warm(x), model(x))
    counts = counters.snapshot()
    assert counts["inductor_compiles"] == 0 and counts["graphs_traced"] == 0, counts


class _FactoryConstants(torch.nn.Module):
    """Tensors made from constants in the forward, as a Hugging Face cache makes them (the empty
    keys a DynamicCache layer starts from, a table of positions): a torch.fx re-trace of the graph's
    code (a GraphModule's pickle) runs those calls and keeps their results as buffers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        keys = torch.cat([torch.tensor([], dtype=x.dtype).view(b, 0, d), x], dim=1)
        return keys.relu() * torch.tensor([0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]) + torch.arange(8)


def test_a_job_crosses_to_the_worker_with_its_graph_as_traced():
    import pickle

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    empty = graph.call_function(torch.zeros, (0, 8))
    scale = graph.call_function(torch.tensor, ([2.0] * 8,))
    graph.output(graph.call_function(torch.mul, (graph.call_function(torch.cat, ([empty, x],)), scale)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    job = pickle.loads(pickle.dumps(PieceJob(gm, (), tessera.CompileConfig(), 8, "x", "", None)))
    assert [n.op for n in job.graph.graph.nodes] == [n.op for n in gm.graph.nodes]  # no get_attr
    assert not list(job.graph.buffers())
    plain = pickle.loads(pickle.dumps(gm))  # what the job did before: the constants made buffers
    assert {n.op for n in plain.graph.nodes} >= {"get_attr"} and list(plain.buffers())
    x = torch.randn(3, 8)
    torch.testing.assert_close(job.graph(x), gm(x))


@pytest.mark.inductor
def test_a_graph_with_factory_constants_compiles_in_the_worker_and_the_next_start_loads_it():
    model = _FactoryConstants()
    compiled = tessera.compile(model, backend="inductor", compile_workers=1, background_compile=True)
    for b, n in [(2, 3), (3, 5)]:  # grad enabled: a caller's default state
        x = torch.randn(b, n, 8)
        torch.testing.assert_close(compiled(x), model(x), msg=f"{b}x{n}, compiling")
    assert compiled.wait_ready(300)
    general = [a for a in _artifacts(compiled, "general") if a.source == "compiled"]
    # Compiled in the worker (a worker that failed would have left it to this process).
    assert general and all(a.worker is not None and a.worker != os.getpid() for a in general)
    for b, n in [(2, 3), (4, 7), (1, 2)]:
        x = torch.randn(b, n, 8)
        torch.testing.assert_close(compiled(x), model(x), msg=f"{b}x{n}, ready")
    torch._dynamo.reset()
    counters.reset()
    warm = tessera.compile(model, backend="inductor", compile_workers=1)
    for b, n in [(6, 4), (2, 3)]:  # the artifact takes the piece's own arguments, no more
        x = torch.randn(b, n, 8)
        torch.testing.assert_close(warm(x), model(x), msg=f"{b}x{n}, warm")
    counts = counters.snapshot()
    assert counts["inductor_compiles"] == 0 and counts["graphs_traced"] == 0, counts


def test_workers_told_to_stop_share_one_deadline_and_are_killed_past_it(monkeypatch):
    # At SCHED_IDLE on a busy machine a worker's exit can wait long for a core: a process that exits
    # waits STOP_SECONDS for all its workers together, not for each in turn.
    monkeypatch.setattr(compile_pool, "STOP_SECONDS", 2.0)
    pool = CompilePool(3)
    deaf = "import time; time.sleep(600)"
    for worker in pool.workers:  # processes that never read their stdin's end
        worker.process = subprocess.Popen([sys.executable, "-c", deaf], stdin=subprocess.PIPE)
    start = time.monotonic()
    pool.stop()
    took = time.monotonic() - start
    assert all(w.process is not None and w.process.returncode == -signal.SIGKILL for w in pool.workers)
    assert 2.0 <= took < 4.5, took  # one after the other: 6 s
