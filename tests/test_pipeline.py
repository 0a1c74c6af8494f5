"""Numbers and behaviour of the compiled callable on the toy Llama (eager compiler: fast)."""

from __future__ import annotations

import pytest
import torch

import tessera
from tessera.models import toy_llama
from tests.custom_compiler import CountingCompiler

SIZES = (3, 1, 16, 17, 64)  # first call at a general size: see test_size_one_first_call


def _check_equal(compiled, model, sizes=SIZES):
    for n in sizes:
        ids, pos = toy_llama.example_inputs(n)
        with torch.no_grad():
            torch.testing.assert_close(compiled(ids, pos), model(ids, pos))


@pytest.mark.parametrize("layers", [1, 3])
def test_toy_llama_piece_structure_and_numbers(layers):
    model = toy_llama.build(num_layers=layers)
    compiled = tessera.compile(model, backend="eager", compile_sizes=[16], compile_ranges=[8])
    # One trace serves every size, 1 included (the model does not treat size 1 apart).
    with tessera.counters.expect(graphs_traced=1, pieces=2 * layers + 1, compiled_pieces=layers + 1):
        _check_equal(compiled, model)
    assert len(compiled.pieces) == 2 * layers + 1
    assert sum(not p.is_splitting for p in compiled.pieces) == layers + 1


def test_dispatch_records_show_which_artifact_served_each_size():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager", compile_sizes=[16], compile_ranges=[8])
    _check_equal(compiled, model)  # 3, 1 -> [1,8]; 16 -> size 16; 17, 64 -> [9,max]
    for record in compiled.pieces:
        if not record.is_splitting:
            assert dict(record.served) == {"general": 0, "size 16": 1, "range [1,8]": 2, "range [9,max]": 2}
    runner = compiled.split_graph.__dict__["submod_0"]
    assert [runner.artifact_for(n) for n in (0, 5, 16, 40)] == [
        "general",
        "range [1,8]",
        "size 16",
        "range [9,max]",
    ]


def test_no_retrace_and_no_dynamo_after_first_call():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager")
    _check_equal(compiled, model, sizes=(5,))
    # With Dynamo's caches wiped, any call that went back through Dynamo would trace again.
    torch._dynamo.reset()
    with tessera.counters.expect(graphs_traced=0, backend_compilations=0):
        _check_equal(compiled, model, sizes=(2, 9, 33))


def test_trace_once_keeps_first_branch_and_stock_retraces():
    def branchy(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            return x * 2
        return x - 1

    once = tessera.compile(branchy, mode="trace_once", backend="eager", max_traces=1)
    torch.testing.assert_close(once(torch.ones(8, 2)), torch.full((8, 2), 2.0))
    torch.testing.assert_close(once(torch.ones(6, 2)), torch.full((6, 2), 2.0))
    # The branch's guard (size >= 5) is part of the call check: never the other branch's answer.
    with pytest.raises(tessera.InputMismatchError, match="5 <= "):
        once(torch.ones(2, 2))
    assert tessera.counters.snapshot()["graphs_traced"] == 1
    assert len(once.pieces) == 1
    # By default the other branch is traced when a call takes it, as stock torch.compile does.
    tessera.counters.reset()
    retraced = tessera.compile(branchy, mode="trace_once", backend="eager")
    torch.testing.assert_close(retraced(torch.ones(8, 2)), torch.full((8, 2), 2.0))
    torch.testing.assert_close(retraced(torch.ones(2, 2)), torch.zeros(2, 2))
    torch.testing.assert_close(retraced(torch.ones(1, 2)), torch.zeros(1, 2))
    # The first trace loaded (the same model's, saved above), the other branch's traced here.
    assert [e.loaded for e in retraced.traces] == [True, False]
    assert tessera.counters.snapshot()["graphs_traced"] == 1

    tessera.counters.reset()
    torch._dynamo.reset()
    stock = tessera.compile(branchy, mode="stock", backend="eager")
    torch.testing.assert_close(stock(torch.ones(8, 2)), torch.full((8, 2), 2.0))
    torch.testing.assert_close(stock(torch.ones(2, 2)), torch.zeros(2, 2))
    assert tessera.counters.snapshot()["graphs_traced"] == 2


@pytest.mark.parametrize("mode", ["trace_once", "piecewise"])
def test_size_above_max_size_raises(mode):
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, mode=mode, backend="eager", max_size=32, compile_ranges=[8])
    _check_equal(compiled, model, sizes=(4, 32))
    with pytest.raises(tessera.SizeNotCompiledError, match="runtime size 33 is not covered"):
        compiled(*toy_llama.example_inputs(33))
    assert isinstance(tessera.SizeNotCompiledError("x"), tessera.TesseraError)


def test_mode_none_is_the_model_itself():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, mode="none")
    with tessera.counters.expect(graphs_traced=0):
        _check_equal(compiled, model, sizes=(3,))
    assert compiled.pieces == ()


def test_custom_compiler_by_module_and_class_name():
    CountingCompiler.compiled.clear()
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="tests.custom_compiler:CountingCompiler", compile_sizes=[4])
    _check_equal(compiled, model, sizes=(4, 7))
    assert CountingCompiler.compiled == [None, 4, None, 4]


def test_bad_custom_compiler_is_a_compiler_error_at_compile_time():
    with pytest.raises(tessera.CompilerError, match="cannot import Missing"):
        tessera.compile(toy_llama.build(num_layers=1), backend="tests.custom_compiler:Missing")


def test_dynamic_dims_errors_name_the_problem():
    model = toy_llama.build(num_layers=1)
    with pytest.raises(tessera.ConfigError, match="dynamic_dims names"):
        tessera.compile(model, backend="eager", dynamic_dims={"tokens": 0})(*toy_llama.example_inputs(3))
    with pytest.raises(tessera.ConfigError, match="out of range"):
        tessera.compile(model, backend="eager", dynamic_dims={"input_ids": 2})(*toy_llama.example_inputs(3))


def test_graph_break_with_fullgraph_is_an_unsupported_model_error():
    def breaks(x: torch.Tensor) -> torch.Tensor:
        print("side effect")  # noqa: T201
        return x + 1

    compiled = tessera.compile(breaks, backend="eager", fullgraph=True)
    with pytest.raises(tessera.UnsupportedModelError, match="cannot be traced as one graph"):
        compiled(torch.ones(3))


def test_legacy_fx_cache_compiler_is_refused_with_a_clear_error():
    with pytest.raises(tessera.ConfigError, match="use backend='inductor'"):
        tessera.compile(toy_llama.build(num_layers=1), backend="inductor_fx")


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_first_call_of_size_one_makes_the_general_trace(backend):
    """Traced size-obliviously, a first call of size 1 makes the trace every size uses: the model
    does not treat size 1 apart, so one trace serves 1, 5, 2 and 9."""
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend=backend)
    with tessera.counters.expect(graphs_traced=1):
        _check_equal(compiled, model, sizes=(1, 1, 5, 2, 9))
    assert len(compiled.traces) == 1
    assert dict(compiled.pieces[0].served) == {"general": 5}
