"""Compiler features: post-grad passes, graph partition, dynamic-shape modes, the compile record."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import tessera
from tessera.config import SizeRange
from tessera.models import toy_llama
from tessera.passes import DeduplicatePass, compiling_size
from tessera.report import CompileReport


def run_toy(compiled, model, sizes):
    with torch.no_grad():
        for n in sizes:
            ids, pos = toy_llama.example_inputs(n)
            torch.testing.assert_close(
                compiled(ids, pos), model(ids, pos), msg=lambda m, n=n: f"size {n}: {m}"
            )


# -- passes ---------------------------------------------------------------------------------------
class RecordingPass:
    """Counts its calls and remembers the size each compile was for."""

    def __init__(self, version: str = "v1") -> None:
        self.version = version
        self.sizes: list[object] = []

    def uuid(self) -> str:
        return f"recording-{self.version}"

    def __call__(self, graph: torch.fx.Graph) -> None:
        assert isinstance(graph, torch.fx.Graph)
        self.sizes.append(compiling_size())


def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w).relu() * 2 + 1


@pytest.mark.inductor
def test_a_pass_runs_once_per_compile_and_sees_the_size():
    recording = RecordingPass()
    options = {"backend": "inductor", "compile_sizes": [4], "compile_ranges": [8], "dynamic_dims": {"x": 0}}
    compiled = tessera.compile(mlp, passes=[recording], **options)
    w = torch.randn(8, 8)
    for n in (5, 4, 9, 2):
        x = torch.randn(n, 8)
        torch.testing.assert_close(compiled(x, w), mlp(x, w))
    counts = tessera.counters.snapshot()
    assert len(recording.sizes) == counts["inductor_compiles"] == 4
    assert sorted(map(str, recording.sizes)) == sorted(
        map(str, [None, 4, SizeRange(1, 8), SizeRange(9, None)])
    )

    # Warm, the same pass: every artifact hits. A new uuid: a new entry, compiled again.
    tessera.counters.reset()
    again = RecordingPass()
    tessera.compile(mlp, passes=[again], **options)(torch.randn(5, 8), w)
    assert tessera.counters.snapshot()["inductor_compiles"] == 0 and again.sizes == []
    changed = RecordingPass("v2")
    tessera.compile(
        mlp,
        backend="inductor",
        passes=[changed],
        compile_sizes=[4],
        compile_ranges=[8],
        dynamic_dims={"x": 0},
    )(torch.randn(5, 8), w)
    assert tessera.counters.snapshot()["inductor_compiles"] == 4 and len(changed.sizes) == 4


@pytest.mark.inductor
def test_a_pass_runs_even_when_inductor_has_compiled_the_same_graph_before():
    # The first compile leaves the graph in Inductor's own cache; tessera's cache is off, so the
    # second is a compile too and its pass must see it.
    for _ in range(2):
        recording = RecordingPass()
        compiled = tessera.compile(mlp, backend="inductor", passes=[recording], disable_cache=True)
        x, w = torch.randn(5, 8), torch.randn(8, 8)
        torch.testing.assert_close(compiled(x, w), mlp(x, w))
        assert recording.sizes == [None]


@pytest.mark.inductor
def test_the_shipped_dedup_pass_rewrites_the_toy_llama_and_keeps_its_numbers():
    dedup = DeduplicatePass()
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="inductor", passes=[dedup], disable_cache=True)
    run_toy(compiled, model, sizes=(5, 1, 17))
    assert dedup.removed > 0  # the rotary table is gathered once per piece, not per q and k


def test_dedup_pass_merges_pure_duplicates_only():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.ops.aten.sin.default, (x,))
    b = graph.call_function(torch.ops.aten.sin.default, (x,))
    r1 = graph.call_function(torch.ops.aten.rand.default, ([2],), {"device": torch.device("cpu")})
    r2 = graph.call_function(torch.ops.aten.rand.default, ([2],), {"device": torch.device("cpu")})
    out = graph.call_function(torch.ops.aten.add.Tensor, (a, b))
    graph.output((out, r1, r2))
    dedup = DeduplicatePass()
    dedup(graph)
    assert dedup.removed == 1  # the two sins merge; random draws never do
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.sin.default) == 1 and targets.count(torch.ops.aten.rand.default) == 2


def test_passes_and_debug_are_reachable_from_the_package():
    code = "import tessera; print(tessera.passes.DeduplicatePass.__name__, tessera.debug.bisect.__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["DeduplicatePass", "bisect"]


def test_passes_need_a_compiler_that_runs_them():
    with pytest.raises(tessera.ConfigError, match="passes run on Inductor's post-grad graph"):
        tessera.compile(mlp, backend="eager", passes=[RecordingPass()])
    with pytest.raises(tessera.ConfigError, match="uuid"):
        tessera.compile(mlp, passes=[lambda graph: None])


# -- graph partition ------------------------------------------------------------------------------
@pytest.mark.inductor
def test_graph_partition_matches_eager_cold_and_warm():
    model = toy_llama.build(num_layers=2)
    cold = tessera.compile(model, backend="inductor", graph_partition=True)
    run_toy(cold, model, sizes=(5, 1, 16, 33))
    assert len(cold.pieces) == 1 and cold.pieces[0].partitions is not None
    # One graph, partitioned by Inductor, serving size 1 too.
    assert tessera.counters.snapshot()["inductor_compiles"] == 1
    tessera.counters.reset()
    warm = tessera.compile(model, backend="inductor", graph_partition=True)
    run_toy(warm, model, sizes=(7, 2, 64))
    assert warm.warm_start is True and tessera.counters.snapshot()["inductor_compiles"] == 0
    assert warm.pieces[0].partitions == cold.pieces[0].partitions


@pytest.mark.inductor
def test_graph_partition_on_a_hugging_face_model():
    from tests.test_hf import build

    model, _ = build("qwen2")
    compiled = tessera.compile(model, backend="inductor", graph_partition=True, dynamic_dims={"input_ids": 1})
    with torch.no_grad():
        for n in (7, 16, 3):
            ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
            expected = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits, expected)
    # One piece, the whole graph, handed to Inductor's partitioner (on CPU it makes no
    # partitions: they exist for CUDA graphs), instead of tessera's 2L+1 pieces.
    assert len(compiled.pieces) == 1 and compiled.pieces[0].partitions is not None


def test_graph_partition_needs_inductor_and_piecewise():
    with pytest.raises(tessera.ConfigError, match="graph_partition=True"):
        tessera.CompileConfig(graph_partition=True, backend="eager")
    with pytest.raises(tessera.ConfigError, match="cudagraph_mode='piecewise'"):
        tessera.CompileConfig(graph_partition=True, cudagraph_mode="piecewise")


# -- dynamic-shape modes --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["backed", "unbacked", "backed_size_oblivious"])
@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_dynamic_shape_modes_match_eager_from_a_first_call_of_size_one(mode, backend):
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend=backend, dynamic_shapes=mode, disable_cache=True)
    run_toy(compiled, model, sizes=(1,))
    assert tessera.counters.snapshot()["graphs_traced"] == 1  # the first call, of size 1, is the trace
    run_toy(compiled, model, sizes=(2, 7, 64, 1))
    # Every mode serves every size from that trace: the model does not treat size 1 apart.
    assert tessera.counters.snapshot()["graphs_traced"] == 1


def test_unknown_dynamic_shape_mode_is_a_config_error():
    with pytest.raises(tessera.ConfigError, match="dynamic_shapes='dynamic' is unknown"):
        tessera.compile(mlp, dynamic_shapes="dynamic")


# -- splitting ------------------------------------------------------------------------------------
def test_adjacent_splitting_ops_form_one_splitting_piece():
    def two_in_a_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = (x @ w).relu()
        y = torch.ops.silly.attention(y, y, y)
        y = torch.ops.silly.attention(y, y, y)  # nothing compiled in between
        return y * 2

    compiled = tessera.compile(two_in_a_row, backend="eager", splitting_ops=["silly::attention"])
    x, w = torch.randn(5, 8), torch.randn(8, 8)
    torch.testing.assert_close(compiled(x, w), two_in_a_row(x, w))
    assert [p.is_splitting for p in compiled.pieces] == [False, True, False]
    assert len(compiled.pieces) == 3


# -- the compile record ---------------------------------------------------------------------------
def test_on_compiled_and_report_cold_and_warm():
    model = toy_llama.build(num_layers=3)
    seen: list[CompileReport] = []
    cold = tessera.compile(model, backend="eager", on_compiled=seen.append)
    run_toy(cold, model, sizes=(5, 9))
    assert len(seen) == 1 and seen[0].kind == "cold"
    report = cold.report
    assert report is not None and report.kind == "cold" and report.phase("trace") > 0
    assert report.pieces == 7 and report.compiled_pieces == 4
    assert {a.source for a in report.artifacts} == {"compiled", "shared"}  # the middle pieces are twins
    assert sum(a.served for a in report.artifacts) == 2 * 4  # two calls, four compiled pieces
    assert dict(report.counters)["graphs_traced"] == 1
    assert report.cache_entry == str(cold.cache_dir) and report.whole_model_artifact == "written"
    json.dumps(report.as_dict())  # JSON-ready

    warm_seen: list[CompileReport] = []
    warm = tessera.compile(model, backend="eager", on_compiled=warm_seen.append)
    run_toy(warm, model, sizes=(4,))
    assert len(warm_seen) == 1 and warm_seen[0].kind == "warm"
    assert warm.report is not None and {a.source for a in warm.report.artifacts} == {"loaded"}
    assert warm.report.whole_model_artifact == "loaded" and "load_kernels" in dict(warm.report.phases)
    assert "graphs_traced" not in dict(warm.report.counters)
    run_toy(warm, model, sizes=(3,))
    assert len(warm_seen) == 1  # called once, not per call


def test_on_compiled_must_be_callable():
    with pytest.raises(tessera.ConfigError, match="on_compiled"):
        tessera.compile(mlp, on_compiled="print")


def test_a_compiled_model_says_its_stage_unbuilt_until_its_first_trace_then_ready():
    from tessera.api import Stage

    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager", compile_sizes=[4])
    assert compiled.stage is Stage.UNBUILT
    args = toy_llama.example_inputs(1)
    torch.testing.assert_close(compiled(*args), model(*args))
    assert compiled.stage is Stage.READY
    args = toy_llama.example_inputs(6)
    torch.testing.assert_close(compiled(*args), model(*args))
    assert compiled.stage is Stage.READY
    with pytest.raises(tessera.TesseraError):
        compiled(torch.zeros(2, 3, 5))  # eager fails on it too (a TesseraError says so), still ready
    assert compiled.stage is Stage.READY
