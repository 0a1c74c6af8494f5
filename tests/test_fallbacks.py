"""Failures told apart: damaged files cost a recompile, loader bugs are raised, every fallback is
counted and reported, and a backend that cannot be used is refused by ``tessera.compile`` itself."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

import tessera
from tessera import errors
from tessera.cache import index
from tessera.cache.entry import INDEX, CacheDamagedWarning
from tessera.models import toy_llama
from tessera.trace import warm as warm_module
from tests.custom_compiler import SavingCompiler

SAVING = "tests.custom_compiler:SavingCompiler"


@pytest.fixture(autouse=True)
def _working_loader():
    SavingCompiler.load_fails_with = None
    yield
    SavingCompiler.load_fails_with = None


def _run(model: torch.nn.Module, backend: str = SAVING) -> tessera.CompiledModel:
    """A fresh process, as far as tessera can tell: Dynamo and the counters reset."""
    torch._dynamo.reset()
    tessera.counters.reset()
    compiled = tessera.compile(model, backend=backend)
    ids, pos = toy_llama.example_inputs(5)
    torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    return compiled


@pytest.mark.parametrize("start", ["warm", "trace"])
def test_a_loader_bug_is_raised_by_name_never_reported_as_damage(start):
    model = toy_llama.build(num_layers=2)
    cold = _run(model)
    entry = cold.cache_dir
    assert entry is not None
    vouched = index.parse((entry / INDEX).read_text()).entries
    if start == "trace":  # no whole-model artifact to start from: the trace loads each piece
        shutil.rmtree(entry.parents[2] / "warm")
    SavingCompiler.load_fails_with = RuntimeError("loader bug: handle read as bytes")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(tessera.CompilerError, match="loader bug: handle read as bytes") as raised:
            _run(model)
    assert not [w for w in caught if issubclass(w.category, CacheDamagedWarning)], [
        str(w.message) for w in caught
    ]
    message = str(raised.value)
    assert "'saving'" in message and "not cache damage" in message and "disable_cache=True" in message
    assert isinstance(raised.value.__cause__, RuntimeError)
    # The entry still vouches for every artifact: the loader, once fixed, loads them all.
    assert index.parse((entry / INDEX).read_text()).entries == vouched
    SavingCompiler.load_fails_with = None
    _run(model)
    counts = tessera.counters.snapshot()
    assert counts["cache_hits"] == counts["backend_compilations"] > 0
    assert counts["artifact_fallbacks"] == 0


def test_bytes_the_compiler_cannot_read_are_damage_recompiled_counted_and_reported():
    model = toy_llama.build(num_layers=2)
    _run(model)
    SavingCompiler.load_fails_with = errors.ArtifactDamaged("not a saving-compiler artifact")
    with pytest.warns(CacheDamagedWarning, match="not a saving-compiler artifact") as caught:
        again = _run(model)
    assert len([w for w in caught if issubclass(w.category, CacheDamagedWarning)]) == 1
    counts = tessera.counters.snapshot()
    assert again.warm_start is False and counts["graphs_traced"] == 1
    assert counts["warm_start_fallbacks"] == 1  # the rebuild stopped at the first damaged piece
    # Every artifact the index vouched for was found damaged and obtained again.
    assert counts["artifact_fallbacks"] == counts["backend_compilations"] > 0
    assert counts["cache_hits"] + counts["cache_misses"] == counts["backend_compilations"]
    report = again.report
    assert report is not None
    assert dict(report.counters)["artifact_fallbacks"] == counts["artifact_fallbacks"]
    assert len(report.fallbacks) == counts["artifact_fallbacks"]
    assert {f.cause for f in report.fallbacks} == {"damage"}
    assert all("not a saving-compiler artifact" in f.reason for f in report.fallbacks)
    assert "fallbacks:" in report.summary()
    assert report.as_dict()["fallbacks"][0]["what"] == "piece artifact"

    SavingCompiler.load_fails_with = None
    warm = _run(model)
    assert warm.warm_start is True
    assert warm.report is not None and warm.report.fallbacks == ()
    assert tessera.counters.snapshot()["artifact_fallbacks"] == 0


def test_an_unexpected_rebuild_failure_warns_once_by_name_and_is_counted(monkeypatch):
    model = toy_llama.build(num_layers=1)
    _run(model, "eager")

    def broken_rebuild(*args, **kwargs):
        raise RuntimeError("rebuild bug")

    monkeypatch.setattr(warm_module, "rebuild_call", broken_rebuild)
    with pytest.warns(errors.FallbackWarning, match=r"RuntimeError: rebuild bug"):
        again = _run(model, "eager")
    assert again.warm_start is False and "rebuild bug" in (again.warm_start_refused or "")
    counts = tessera.counters.snapshot()
    assert counts["warm_start_fallbacks"] == 1 and counts["graphs_traced"] == 1
    assert again.report is not None and dict(again.report.counters)["warm_start_fallbacks"] == 1
    assert "1 warm start" in again.report.summary()

    with warnings.catch_warnings():
        warnings.simplefilter("error", errors.FallbackWarning)  # once per process, not per model
        third = _run(model, "eager")
    assert third.warm_start is False
    assert tessera.counters.snapshot()["warm_start_fallbacks"] == 1


def test_an_expected_fallback_is_counted_without_a_warning():
    """A whole-model artifact whose index lost a piece: one trace, counted, INFO only."""
    model = toy_llama.build(num_layers=2)
    cold = _run(model, "eager")
    entry = cold.cache_dir
    assert entry is not None
    parsed = index.parse((entry / INDEX).read_text())
    del parsed.entries[max(parsed.entries, key=lambda key: key[1])]
    (entry / INDEX).write_text(parsed.format())
    again = _run(model, "eager")  # any tessera warning would be an error here (pyproject)
    assert again.warm_start is False and "its artifact is missing" in (again.warm_start_refused or "")
    assert tessera.counters.snapshot()["warm_start_fallbacks"] == 1


def test_no_whole_model_artifact_yet_is_a_cold_start_not_a_fallback():
    _run(toy_llama.build(num_layers=1), "eager")
    assert tessera.counters.snapshot()["warm_start_fallbacks"] == 0


@pytest.mark.parametrize(
    ("backend", "error", "words"),
    [
        ("pkg:Missing", tessera.CompilerError, "cannot import Missing from pkg"),
        ("tests.custom_compiler:NoSuchCompiler", tessera.CompilerError, "cannot import NoSuchCompiler"),
        ("tests.custom_compiler:SavingCompiler.x", tessera.CompilerError, "cannot import"),
        ("inductor_fx", tessera.ConfigError, "use backend='inductor'"),
        ("nonsense", tessera.ConfigError, "is unknown"),
    ],
)
def test_a_backend_that_cannot_be_used_is_refused_by_compile_itself(backend, error, words):
    model = toy_llama.build(num_layers=1)
    with pytest.raises(error, match=words):
        tessera.compile(model, backend=backend)


def test_stock_mode_refuses_a_compiler_it_cannot_run_at_compile_time():
    with pytest.raises(tessera.ConfigError, match="mode='stock'"):
        tessera.compile(toy_llama.build(num_layers=1), mode="stock", backend=SAVING)


def test_a_retired_backend_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("TESSERA_BACKEND", "inductor_fx")
    with pytest.raises(tessera.ConfigError, match="TESSERA_BACKEND"):
        tessera.compile(toy_llama.build(num_layers=1))


def test_a_call_outside_what_the_compile_assumed_runs_the_piece_as_traced_quietly():
    from tessera.compilation.inductor_compiler import GuardedCode
    from tessera.compilation.piece import PieceRunner

    def compiled(x: torch.Tensor) -> torch.Tensor:  # code right only where dim 1 is 14
        assert x.shape[1] == 14
        return x * 2

    traced_calls = []

    def as_traced(x: torch.Tensor) -> torch.Tensor:
        traced_calls.append(x.shape)
        return x + x

    holds = tessera._compat.guard_check("L['t0'].size()[1] == 14")
    runner = PieceRunner("submod_0", {None: GuardedCode(compiled, holds)}, None, None)
    tessera.counters.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FallbackWarning: a planned path, not a bug
        x = torch.randn(3, 14)
        torch.testing.assert_close(runner(x), x * 2)
        assert traced_calls == []
        with pytest.raises(errors.CompilerError, match="not at hand"):
            runner(torch.randn(3, 15))  # never the compiled code, even with nothing else to run
        runner.as_traced = as_traced
        y = torch.randn(3, 15)
        torch.testing.assert_close(runner(y), y * 2)
    assert traced_calls == [(3, 15)]
    assert runner.guarded() and tessera.counters.snapshot()["outside_assumptions"] == 1
    assert dict(runner.served()) == {"general": 1}


@pytest.mark.inductor
def test_a_compile_whose_assumptions_cannot_be_written_never_serves_its_code(monkeypatch, tmp_path):
    def unwritable(values, baseline):
        raise ValueError("a symbol no input holds")

    monkeypatch.setattr(tessera._compat, "compile_assumptions", unwritable)
    torch._dynamo.reset()
    tessera.counters.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).requires_grad_(False)
    compiled = tessera.compile(model, background_compile=False, cache_dir=str(tmp_path))
    for n in (3, 5, 7):
        x = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x), model(x))
    assert tessera.counters.snapshot()["outside_assumptions"] >= 3  # every call ran as traced
