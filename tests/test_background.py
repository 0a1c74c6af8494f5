"""Serve first, specialise after: the first output waits for the trace alone (pieces serve as
traced); general artifacts, then compile sizes and ranges, compile in the background and are
swapped in when ready, equal to eager at every moment. (The rest of the suite compiles up
front: TESSERA_BACKGROUND_COMPILE=0, conftest.)"""

from __future__ import annotations

import contextvars
import importlib
import logging
import threading
from typing import Any, ClassVar

import pytest
import torch

import tessera
from tessera.models import toy_llama
from tests.child import run_toy


@pytest.fixture(autouse=True)
def _trace_on_the_first_call(monkeypatch):
    """These tests follow a trace's pieces from traced to compiled: the first call traces (eager
    first, where the first calls are served eagerly while the trace is made, is tests/test_eager_first.py)."""
    monkeypatch.setattr("tessera.api.eager_first", lambda config: False)


class GatedCompiler:
    """Runs graphs as Python; a general compile waits for ``general_gate``, a compile for a static
    size or a range for ``gate`` (the test holds the background compile where it wants it), and
    a size raises if ``fail`` is set. ``sizes_waiting`` is set when a size compile starts
    (the background compiles every general artifact, and swaps it in, before any size)."""

    name = "gated"
    gate: ClassVar[threading.Event] = threading.Event()
    general_gate: ClassVar[threading.Event] = threading.Event()
    sizes_waiting: ClassVar[threading.Event] = threading.Event()
    fail: ClassVar[bool] = False
    compiled: ClassVar[list[Any]] = []
    compiled_calls: ClassVar[list[Any]] = []  # the size of each call a compiled artifact served

    def compute_hash(self) -> str:
        return "gated-v1"

    def initialize_cache(self, cache_dir: Any) -> None:
        pass

    def compile(self, graph, example_inputs, config, size, key):
        if size is None:
            assert GatedCompiler.general_gate.wait(60), "the test never opened the general gate"
        else:
            GatedCompiler.sizes_waiting.set()
            assert GatedCompiler.gate.wait(60), "the test never opened the gate"
            if GatedCompiler.fail:
                raise RuntimeError("this compiler cannot do static sizes")
        GatedCompiler.compiled.append(size)

        def artifact(*args: Any) -> Any:
            GatedCompiler.compiled_calls.append(size)
            return graph.forward(*args)

        return artifact, None

    def load(self, handle, graph, example_inputs, index, size):
        raise AssertionError("nothing is saved, so nothing is loaded")


@pytest.fixture
def gated():
    # The class tessera loads by name (pytest may import this file under another module name).
    cls = importlib.import_module("tests.test_background").GatedCompiler
    for event in (cls.gate, cls.general_gate, cls.sizes_waiting):
        event.clear()
    cls.fail = False
    cls.compiled = []
    cls.compiled_calls = []
    yield cls
    cls.gate.set()  # never leave a background thread waiting
    cls.general_gate.set()


def served(compiled: tessera.CompiledModel) -> dict[str, int]:
    return dict(next(p for p in compiled.pieces if not p.is_splitting).served)


def gated_model(layers: int, **options: Any) -> tuple[torch.nn.Module, tessera.CompiledModel]:
    model = toy_llama.build(num_layers=layers)
    compiled = tessera.compile(
        model,
        backend="tests.test_background:GatedCompiler",
        background_compile=True,
        disable_cache=True,
        **options,
    )
    return model, compiled


def test_the_first_output_waits_for_the_trace_alone_then_general_then_sizes_swap_in(gated):
    model, compiled = gated_model(2, compile_sizes=[8], compile_ranges=[16])
    # Nothing compiled yet: every piece serves as traced (eager kernels), equal to eager.
    for n in (5, 8, 20):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, as traced")
    assert not compiled.ready and not compiled.wait_ready(0.05)
    assert gated.compiled == [] and gated.compiled_calls == []
    assert served(compiled) == {"general (as traced)": 3}
    report = compiled.report
    assert report is not None and report.background == "running" and report.all_sizes_ready_seconds is None
    assert "serve as traced" in report.summary()
    assert {a.source for a in report.artifacts} == {"as traced"}
    # Every general artifact compiled and swapped in; the sizes are held at their gate.
    gated.general_gate.set()
    assert gated.sizes_waiting.wait(60)
    assert set(gated.compiled) == {None} and not compiled.ready
    for n in (5, 8, 20):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, general")
    assert served(compiled) == {"general (as traced)": 3, "general": 3}
    assert gated.compiled_calls and set(gated.compiled_calls) == {None}
    gated.gate.set()
    assert compiled.wait_ready(60) and compiled.ready
    for n in (8, 20, 5):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, every size")
    assert served(compiled) == {
        "general (as traced)": 3,
        "general": 3,
        "size 8": 1,
        "range [1,16]": 1,
        "range [17,max]": 1,
    }
    report = compiled.report
    assert report is not None and report.background == "done"
    assert (
        report.all_sizes_ready_seconds is not None and report.all_sizes_ready_seconds >= report.total_seconds
    )
    assert "every size ready" in report.summary()


def test_without_serving_while_compiling_the_first_output_waits_for_the_general_artifacts(gated):
    gated.general_gate.set()
    model, compiled = gated_model(2, compile_sizes=[8], serve_while_compiling=False)
    for n in (5, 8):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens")
    assert gated.compiled and set(gated.compiled) == {None}, "only general artifacts so far"
    assert served(compiled) == {"general": 2} and not compiled.ready
    gated.gate.set()
    assert compiled.wait_ready(60)


def test_a_size_one_service_gets_its_listed_size_from_the_general_trace(gated):
    # A size-1 decode service: the first call, of size 1, is the general trace (size-oblivious),
    # served as traced until its general artifact, then by the size-1 artifact once compiled.
    gated.general_gate.set()
    gated.gate.set()
    model, compiled = gated_model(1, compile_sizes=[1, 8])
    args = toy_llama.example_inputs(1)
    torch.testing.assert_close(compiled(*args), model(*args))
    assert compiled.wait_ready(60)
    for _ in range(3):
        torch.testing.assert_close(compiled(*args), model(*args))
    assert set(gated.compiled) == {None, 1, 8}
    assert served(compiled)["size 1"] == 3 and len(compiled.traces) == 1


def test_a_failed_background_compile_is_said_once_and_the_general_artifacts_keep_serving(gated, caplog):
    gated.fail = True
    gated.gate.set()
    gated.general_gate.set()
    model, compiled = gated_model(1, compile_sizes=[8])
    with caplog.at_level(logging.WARNING, logger="tessera.serving.schedule"):
        args = toy_llama.example_inputs(8)
        torch.testing.assert_close(compiled(*args), model(*args))
        assert compiled.wait_ready(60)
    failures = [r for r in caplog.records if "background compile failed" in r.getMessage()]
    assert len(failures) == 1
    torch.testing.assert_close(compiled(*args), model(*args))
    assert served(compiled) == {"general (as traced)": 1, "general": 1}
    report = compiled.report
    assert report is not None and report.background.startswith("failed: RuntimeError")


def test_background_off_compiles_every_size_before_the_first_output():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(
        model, backend="eager", compile_sizes=[8], compile_ranges=[16], background_compile=False
    )
    compiled(*toy_llama.example_inputs(5))
    counts = tessera.counters.snapshot()
    # general, size 8, ranges [1,16] and [17,max]: every one before the first output
    assert counts["backend_compilations"] == 4 * counts["compiled_pieces"]
    assert compiled.ready and compiled.report is not None and compiled.report.background == "none"


@pytest.mark.inductor
def test_inductor_in_the_background_equals_eager_and_the_next_process_starts_warm(tmp_path):
    model = toy_llama.build(num_layers=2)
    compiled = tessera.compile(model, backend="inductor", compile_sizes=[8], background_compile=True)
    sizes = (6, 8, 3, 17)
    for n in sizes:
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, compiling")
    assert compiled.wait_ready(300)
    for n in sizes:
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, ready")
    assert served(compiled).get("size 8", 0) >= 1
    # A process that calls once and exits at once, its exit waiting for the background compile
    # (finish_at_exit, as tests/child.py sets it), leaves every artifact behind: on the defaults
    # its one call is traced in its thread, and the next process starts warm with nothing compiled.
    cache = tmp_path / "child-cache"
    env = {"TESSERA_BACKGROUND_COMPILE": "1"}
    cold = run_toy(cache, tmp_path / "cold.pt", "--sizes", "5", "--compile-sizes", "8", **env)
    warm = run_toy(cache, tmp_path / "warm.pt", "--sizes", "5,8", "--compile-sizes", "8", **env)
    # The cold child's counters are read after its call, while its trace may still be made.
    assert cold["warm_start"] is not True and cold["counters"].get("served_eagerly", 0) == 0
    assert warm["warm_start"] is True and warm["counters"]["inductor_compiles"] == 0, warm["counters"]
    counts = warm["counters"]
    assert counts.get("graphs_traced", 0) == 0
    assert counts["artifacts_loaded"] == 2 * counts["compiled_pieces"], "general and size 8 of each piece"


def test_pieces_serve_as_traced_with_a_remote_tier_too():
    # With a fleet's shared store the compile turn is the background compile's (one replica
    # compiles, the others serve as traced meanwhile and load): tests/test_object_store.py runs it.
    from tessera.compilation.compilers import make_compiler
    from tessera.serving.build import serves_traced
    from tessera.serving.split_model import SplitModel

    config = tessera.CompileConfig(backend="inductor", background_compile=True)
    alone = SplitModel(config, make_compiler("inductor"), None, "m", serve_traced=True)
    fleet = SplitModel(config, make_compiler("inductor"), None, "m", remote=object(), serve_traced=True)  # type: ignore[arg-type]
    assert alone.entry is None and alone.artifact_cache.entry is None
    assert serves_traced(alone) and serves_traced(fleet)
    up_front = tessera.CompileConfig(backend="inductor", background_compile=False)
    assert not serves_traced(SplitModel(up_front, make_compiler("inductor"), None, "m", serve_traced=True))


SETTING: contextvars.ContextVar[str] = contextvars.ContextVar("setting", default="unset")


class StateRecorder:
    """Runs graphs as Python, recording the state each compile ran under and in which thread."""

    name = "state-recorder"
    seen: ClassVar[list[dict[str, Any]]] = []

    def compute_hash(self) -> str:
        return "state-recorder-v1"

    def initialize_cache(self, cache_dir: Any) -> None:
        pass

    def compile(self, graph, example_inputs, config, size, key):
        StateRecorder.seen.append(
            {
                "size": size,
                "thread": threading.current_thread().name,
                "grad": torch.is_grad_enabled(),
                "autocast": torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
                "default_dtype": torch.get_default_dtype(),
                # A context variable, as Inductor's settings are (torch 2.13: config.x = v).
                "setting": importlib.import_module("tests.test_background").SETTING.get(),
            }
        )
        return graph.forward, None

    def load(self, handle, graph, example_inputs, index, size):
        raise AssertionError("nothing is saved, so nothing is loaded")


@pytest.mark.parametrize("grad_state", [torch.no_grad, torch.inference_mode])
def test_the_background_compiles_under_the_traced_calls_state_not_the_threads(grad_state):
    # A new thread starts with grad enabled and no autocast: compiling there as is would make
    # autograd graphs of a model whose parameters require grad, and drop the call's autocast.
    recorder = importlib.import_module("tests.test_background").StateRecorder
    recorder.seen = []
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    assert all(p.requires_grad for p in model.parameters()), "the parameters as a model makes them"
    compiled = tessera.compile(
        model, backend="tests.test_background:StateRecorder", compile_sizes=[16], background_compile=True
    )
    x = torch.randn(8, 16)
    setting = importlib.import_module("tests.test_background").SETTING
    token = setting.set("the user's")
    with grad_state(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
        setting.reset(token)
        assert compiled.wait_ready(60)
        torch.testing.assert_close(out, model(x))
        assert out.dtype == torch.bfloat16
    background = [s for s in recorder.seen if s["thread"].startswith("tessera-compile")]
    assert {s["size"] for s in background} == {None, 16}, recorder.seen
    for state in recorder.seen:
        assert state["grad"] is False and state["autocast"] == torch.bfloat16, state
        assert state["default_dtype"] == torch.float32 and state["setting"] == "the user's", state


def test_no_background_thread_starts_once_the_process_exits_and_a_running_one_is_told():
    # A thread that starts work once the exit has begun is not started; one that runs is told
    # (background.CLOSING) before the interpreter joins it.
    script = """
import threading
from tessera.compilation import background
ran = []
def worker():
    background.CLOSING.wait()
    print("told", flush=True)
    ran.append(background.start_thread("late", lambda: print("late ran", flush=True)))
    print("late started:", ran[0] is not None, flush=True)
background.start_thread("first", worker)
"""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "told" in proc.stdout and "late started: False" in proc.stdout, proc.stdout
    assert "late ran" not in proc.stdout
