"""Sizes learnt from traffic (compile_sizes="auto"): what is learnt, retired, served, and loaded by
the next process; with threads calling, every output equal to eager's. The learner alone is tested
on counts; the served path on the toy Llama (eager compiler; one Inductor case, cold and warm)."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tessera
from tessera import config
from tessera.cache.key import config_record
from tessera.cli.picture import render_html
from tessera.config import CompileConfig
from tessera.errors import ConfigError
from tessera.models import toy_llama
from tessera.serving import learn, pieces as pieces_module
from tests.child import run_json
from tests.test_cudagraph_logic import StandInGraphs


# -- configuration --------------------------------------------------------------------------------
def test_auto_alone_or_beside_listed_sizes(monkeypatch):
    assert CompileConfig(compile_sizes="auto").sizes == ()
    assert CompileConfig(compile_sizes="auto").auto_sizes == config.DEFAULT_LIMIT
    both = CompileConfig(compile_sizes=[1, 8, "auto"], auto_sizes=3)
    assert (both.sizes, both.auto_sizes) == ((1, 8), 3)
    assert CompileConfig(compile_sizes=[1, 8]).auto_sizes == 0
    monkeypatch.setenv("TESSERA_COMPILE_SIZES", "2,auto")
    from_env = CompileConfig()
    assert (from_env.sizes, from_env.auto_sizes) == ((2,), config.DEFAULT_LIMIT)
    # "auto" changes no artifact's code: the same cache key as the listed sizes alone.
    assert config_record(from_env) == config_record(CompileConfig(compile_sizes=[2]))


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"auto_sizes": -1}, "auto_sizes=-1"),
        ({"auto_sizes_share": 0}, "auto_sizes_share=0"),
        ({"auto_sizes_share": 1.5}, "auto_sizes_share=1.5"),
        ({"compile_sizes": ["auto", "bad"]}, "compile_sizes must hold integers"),
    ],
)
def test_bad_auto_settings_are_config_errors(change, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        CompileConfig(**change)


# -- the learner ----------------------------------------------------------------------------------
class Recorder:
    def __init__(self) -> None:
        self.learnt: list[int] = []
        self.retired: list[int] = []

    def learner(self, limit: int = 8, share: float = 0.05, listed=(), learnt=()) -> learn.SizeLearner:
        return learn.SizeLearner(
            limit, share, listed, learnt, self.learnt.append, self.retired.append, lambda: True
        )


def feed(learner: learn.SizeLearner, sizes: list[int], times: int) -> None:
    for _ in range(times):
        for size in sizes:
            learner.seen(size)


def test_hot_sizes_are_learnt_hottest_first_and_cold_and_listed_ones_are_not():
    recorder = Recorder()
    learner = recorder.learner(listed=[2])
    # 1: 40%, 2: 30% (listed), 3: 20%, then ten sizes at 1% each.
    traffic = [1] * 40 + [2] * 30 + [3] * 20 + list(range(10, 20))
    feed(learner, traffic, 20)
    assert recorder.learnt == [1, 3]  # one per look, hottest first
    assert learner.learnt == (1, 3)
    assert recorder.retired == []


def test_at_most_limit_sizes_and_a_much_hotter_one_takes_the_coldest_place():
    recorder = Recorder()
    learner = recorder.learner(limit=2)
    feed(learner, [1] * 5 + [2] * 3 + [3] * 2, 40)
    assert learner.learnt == (1, 2)  # 3 (20%) is not twice as hot as 2 (30%): no churn
    feed(learner, [5] * 9 + [1], 400)  # the traffic moves to 5
    assert 5 in learner.learnt and recorder.retired == [2]
    assert len(learner.learnt) == 2


def test_a_size_whose_compile_failed_is_not_tried_again():
    recorder = Recorder()
    learner = recorder.learner()
    feed(learner, [7], 2 * learn.EVERY)  # seen in two windows in a row: learnt
    learner.refuse(7)
    feed(learner, [7], 640)
    assert recorder.learnt == [7] and learner.learnt == ()


def test_a_burst_at_start_up_is_not_learnt_until_traffic_confirms_it():
    recorder = Recorder()
    learner = recorder.learner()
    feed(learner, [512], 10)  # warm-up calls: 10 of the first window's 64, 16%
    feed(learner, [1, 2, 3, 4, 5, 6, 7, 8], 30)
    assert 512 not in recorder.learnt and recorder.learnt  # the traffic's sizes are learnt
    feed(learner, [512], 1)  # a look between windows (after a compile, before ready) decides the same
    learner.look(decay=False)
    assert 512 not in recorder.learnt
    # Traffic that keeps the size, window after window, confirms it.
    feed(learner, [512] * 4 + [1], 60)
    assert 512 in recorder.learnt


def test_one_call_before_any_look_is_not_learnt():
    recorder = Recorder()
    learner = recorder.learner()
    feed(learner, [300], 1)  # a warm-up call, counted while the background compile ran
    learner.look(decay=False)  # the look when the compile is done
    assert recorder.learnt == []


# -- served -----------------------------------------------------------------------------------------
def test_threads_calling_while_sizes_are_learnt_get_eager_results_and_the_next_process_loads_them(
    tmp_path: Path,
):
    cold = run_json("tests.run_auto_sizes", "eager", "skewed", cache=tmp_path)
    assert cold["first_kind"] == "cold"
    assert sorted(cold["learnt"]) == [1, 4, 6]  # the hot sizes, no cold one
    assert cold["counters"]["sizes_learnt"] == 3
    assert {"size 1", "size 4", "size 6"} <= set(cold["served_by"])
    warm = run_json("tests.run_auto_sizes", "eager", "none", cache=tmp_path)
    assert warm["first_kind"] == "warm"
    assert sorted(warm["learnt"]) == [1, 4, 6]
    assert warm["counters"]["eager_compiles"] == 0 and warm["counters"]["graphs_traced"] == 0
    assert {tuple(o) for o in warm["obtained"]} >= {(f"size {s}", "loaded") for s in (1, 4, 6)}


def test_a_retired_size_goes_back_to_the_general_artifact_and_out_of_the_record():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager", compile_sizes="auto", auto_sizes=1)

    inputs = {n: toy_llama.example_inputs(n) for n in (3, 5)}

    def call(size: int, check: bool = True) -> None:
        out = compiled(*inputs[size])
        if check:
            torch.testing.assert_close(out, model(*inputs[size]))

    for i in range(2 * learn.EVERY):
        call(3, check=i % 16 == 0)
    assert compiled.wait_ready(60)
    assert compiled.report.learnt_sizes == (3,)
    for i in range(8 * learn.EVERY):  # the traffic moves to 5; 3 cools down
        call(5, check=i % 16 == 0)
    assert compiled.wait_ready(60)
    assert compiled.report.learnt_sizes == (5,)
    assert tessera.counters.snapshot()["sizes_retired"] == 1
    runner = next(r for r in compiled.runners.values() if r.source is not None)
    assert runner.sizes() == (5,) and runner.artifact_for(3) == "general"
    call(3)
    call(5)


def test_learnt_sizes_are_the_capture_sizes_under_cuda_graphs(monkeypatch):
    graphs = StandInGraphs()
    monkeypatch.setattr(pieces_module, "cuda_graphs_available", lambda mode: True)
    monkeypatch.setattr(pieces_module, "CUDAGraphPool", lambda: graphs)
    model = toy_llama.build_decode(num_layers=1, max_batch=16, max_len=64)
    reference = copy.deepcopy(model)
    compiled = tessera.compile(model, backend="eager", cudagraph_mode="piecewise", compile_sizes="auto")
    generator = torch.Generator().manual_seed(0)

    def step(batch: int, position: int) -> None:
        ids = torch.randint(0, 256, (batch,), generator=generator)
        pos = torch.full((batch,), position)
        with torch.no_grad():  # the decode model writes its KV cache in place
            torch.testing.assert_close(compiled(ids, pos), reference(ids, pos))

    for position in range(2 * learn.EVERY + 1):
        step(8, position % 60)
    assert compiled.wait_ready(60)
    assert compiled.report.learnt_sizes == (8,)
    assert all(p.cudagraph_sizes == () for p in compiled.pieces)  # records keep the configured list
    for position in range(3):
        step(5, position)  # padded up to the learnt 8, replayed
    # Nothing was captured before 8 was learnt; each piece once at 8 since (5 pads to it).
    assert tessera.counters.snapshot()["cudagraphs_captured"] == sum(
        not p.is_splitting for p in compiled.pieces
    )
    assert graphs.replays >= 2
    step(12, 3)  # above every learnt size: no graph, still eager's result
    # Replayed calls are counted too: 5, served by graph 8, becomes hot and is learnt.
    for position in range(2 * learn.EVERY):
        step(5, position % 60)
    assert compiled.wait_ready(60)
    assert compiled.report.learnt_sizes == (8, 5)
    # The learning runs at the background priority, beside the calls: it may land after them.
    for position in range(2):
        step(5, position)
    served = {(size, label) for size, label, _ in compiled.report.sizes_served}
    assert (5, "size 8 (graph)") in served and (5, "size 5 (graph)") in served


# -- the picture --------------------------------------------------------------------------------------
def test_a_warm_process_learns_the_sizes_its_traffic_adds_and_the_next_one_loads_them(tmp_path: Path):
    """The pieces a warm process loaded compile a size it learns from their graphs and inputs as
    saved: nothing is traced, only the new size compiles, and the process after it loads it too."""
    run_json("tests.run_auto_sizes", "eager", "skewed", cache=tmp_path)
    warm = run_json("tests.run_auto_sizes", "eager", "moved", cache=tmp_path)
    assert warm["first_kind"] == "warm" and warm["counters"]["graphs_traced"] == 0
    assert sorted(warm["learnt"]) == [1, 4, 6, 9]
    assert warm["counters"]["sizes_learnt"] == 1
    assert "size 9" in warm["served_by"]
    assert {tuple(o) for o in warm["obtained"]} >= {("size 9", "compiled"), ("size 1", "loaded")}
    after = run_json("tests.run_auto_sizes", "eager", "none", cache=tmp_path)
    assert sorted(after["learnt"]) == [1, 4, 6, 9]
    assert after["counters"]["eager_compiles"] == 0 and after["counters"]["graphs_traced"] == 0
    assert ("size 9", "loaded") in {tuple(o) for o in after["obtained"]}


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_learns_cold_loads_warm_and_the_picture_names_every_artifact(tmp_path: Path):
    html = tmp_path / "report.html"
    # As a service runs: the first output before any compile, sizes learnt once the general
    # artifacts are in (the calls made meanwhile counted).
    cold = run_json(
        "tests.run_auto_sizes",
        "inductor",
        "skewed",
        str(html),
        cache=tmp_path,
        TESSERA_BACKGROUND_COMPILE="1",
    )
    assert sorted(cold["learnt"]) == [1, 4, 6]
    assert cold["counters"]["inductor_compiles"] > 0
    page = html.read_text(encoding="utf-8")
    assert cold["files"] and all(name in page for name in cold["files"])
    assert page.count("<svg") == 2 and "static size (learnt from traffic)" in page
    warm = run_json(
        "tests.run_auto_sizes", "inductor", "none", cache=tmp_path, TESSERA_BACKGROUND_COMPILE="1"
    )
    assert warm["first_kind"] == "warm" and sorted(warm["learnt"]) == [1, 4, 6]
    assert warm["counters"]["inductor_compiles"] == 0 and warm["counters"]["sizes_learnt"] == 0
    assert {"size 1", "size 4", "size 6"} <= set(warm["served_by"])  # from its first calls
    # A warm process that learns a size its traffic adds: on Inductor in the batch x length test
    # below, and for sizes on the eager compiler above (a third process here cost CI 45 s).


@pytest.mark.inductor
@pytest.mark.slow
def test_inductor_learns_batch_x_length_shapes_cold_and_loads_them_warm_on_the_defaults(tmp_path: Path):
    """A BERT whose calls vary in batch and length, on the defaults (Inductor, background compile,
    eager first), in two fresh processes: the first learns the hot shapes; the second loads them
    and serves them from its first calls, compiling nothing."""
    html = tmp_path / "report.html"
    defaults = {"TESSERA_BACKGROUND_COMPILE": "1", "TESSERA_COMPILE_WORKERS": ""}
    cold = run_json("tests.run_auto_sizes", "inductor", "shapes", str(html), cache=tmp_path, **defaults)
    assert sorted(cold["learnt"]) == [[2, 16], [4, 8]], cold["learnt"]  # batch x length, in that order
    assert cold["counters"]["inductor_compiles"] > 0 and cold["counters"]["graphs_traced"] >= 1
    assert sum(label.startswith("shape ") for label in cold["served_by"]) == 2, cold["served_by"]
    # Compiled by the compile worker, off the GIL of the process serving meanwhile.
    assert {"shape 2x16", "shape 4x8"} <= set(cold["by_worker"]), cold["by_worker"]
    assert "shape " in html.read_text(encoding="utf-8")
    warm = run_json("tests.run_auto_sizes", "inductor", "shapes-none", cache=tmp_path, **defaults)
    assert warm["first_kind"] == "warm" and sorted(warm["learnt"]) == [[2, 16], [4, 8]]
    assert warm["counters"]["inductor_compiles"] == 0 and warm["counters"]["graphs_traced"] == 0
    assert sum(label.startswith("shape ") for label in warm["served_by"]) == 2, warm["served_by"]
    # A warm process whose traffic adds a hot shape learns it: compiled by Inductor from the
    # pieces' graphs and inputs as saved, nothing traced; eager's numbers throughout (the helper).
    moved = run_json("tests.run_auto_sizes", "inductor", "shapes-moved", cache=tmp_path, **defaults)
    assert moved["first_kind"] == "warm" and moved["counters"]["graphs_traced"] == 0
    assert sorted(moved["learnt"]) == [[2, 16], [3, 6], [4, 8]], moved["learnt"]
    assert moved["counters"]["sizes_learnt"] == 1 and moved["counters"]["inductor_compiles"] > 0
    assert sum(label.startswith("shape ") for label in moved["served_by"]) == 3, moved["served_by"]
    # The warm process had no compile worker (it compiled nothing): the learnt shape started one.
    assert moved["by_worker"] == ["shape 3x6"], moved["by_worker"]
    assert moved["counters"]["compile_workers_started"] == 1


def test_report_html_from_the_command_line_draws_a_scripts_models(tmp_path: Path):
    script = tmp_path / "serve.py"
    script.write_text(
        "import torch, tessera\n"
        "from tessera.models import toy_llama\n"
        "model = toy_llama.build(num_layers=1)\n"
        "compiled = tessera.compile(model, backend='eager', compile_sizes=[2, 'auto'])\n"
        "for n in [2, 3, 3, 9]:\n"
        "    ids, pos = toy_llama.example_inputs(n)\n"
        "    torch.testing.assert_close(compiled(ids, pos), model(ids, pos))\n"
    )
    out = tmp_path / "picture.html"
    proc = subprocess.run(
        [sys.executable, "-m", "tessera", "report", str(script), "--html", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**__import__("os").environ, "TESSERA_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr
    page = out.read_text(encoding="utf-8")
    assert "Compile timeline" in page and "Sizes served" in page
    # The histogram: sizes 2 (its static artifact), 3 and 9 (general).
    assert "size 2: 1 call(s) served by static size (listed)" in page
    assert "size 3: 2 call(s) served by general (symbolic size)" in page


def test_the_picture_of_a_report_without_calls_says_so():
    report = {
        "model": "m",
        "kind": "cold",
        "total_seconds": 0.1,
        "pieces": 0,
        "compiled_pieces": 0,
        "backend": "eager",
        "cache_entry": None,
        "whole_model_artifact": "not written",
        "artifacts": [],
    }
    page = render_html([report])
    assert "No compile in this process." in page and "No call with a size counted yet." in page


# -- batch x length ---------------------------------------------------------------------------------
def _bert():
    transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")
    config = transformers.BertConfig(
        vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    return transformers.BertModel(config).eval().requires_grad_(False)  # served: frozen, grad mode on


def _bert_traffic(calls: int) -> list[tuple[int, int]]:
    """Batch x length: two hot shapes (40% and 30% of the calls), the rest spread thin."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(calls):
        pick = int(torch.randint(0, 10, (1,), generator=generator))
        if pick < 4:
            out.append((2, 16))
        elif pick < 7:
            out.append((4, 8))
        else:
            batch, length = (int(v) for v in torch.randint(1, 6, (2,), generator=generator))
            out.append((batch, 3 * length + 1))
    return out


def test_pieces_with_batch_and_length_learn_the_hot_shapes_and_a_warm_process_loads_them():
    model = _bert()
    ids = {
        shape: torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(7))
        for shape in set(_bert_traffic(4 * learn.EVERY)) | {(3, 11), (1, 40)}
    }

    def serve(compiled, shapes, check_every: int = 8):
        for i, shape in enumerate(shapes):
            out = compiled(input_ids=ids[shape])  # grad enabled: PyTorch's default state
            if i % check_every == 0:
                torch.testing.assert_close(
                    out.last_hidden_state, model(input_ids=ids[shape]).last_hidden_state
                )

    compiled = tessera.compile(model, backend="eager", compile_sizes="auto")
    serve(compiled, _bert_traffic(4 * learn.EVERY))
    assert compiled.wait_ready(120)
    learnt = compiled.report.learnt_sizes
    assert set(learnt) == {(2, 16), (4, 8)}, learnt  # the hot shapes (batch x length), no cold one
    assert tessera.counters.snapshot()["sizes_learnt"] == 2
    # Hot shapes now go to their own artifacts, every other shape to the general one: eager's
    # numbers for each, learnt or not, including shapes never seen.
    serve(compiled, [(2, 16), (4, 8), (3, 11), (1, 40)] * 2, check_every=1)
    by_label = {  # a piece that sees one of the two sizes counts ints (transformers 5.17 has one)
        label for size, label, _ in compiled.report.sizes_served if size == (2, 16)
    }
    assert any(label.startswith("shape ") for label in by_label), by_label
    # The next process (a second compile of the same model: the cache) loads the learnt shapes.
    tessera.counters.reset()
    again = tessera.compile(model, backend="eager", compile_sizes="auto")
    serve(again, [(2, 16), (4, 8), (3, 11)], check_every=1)
    assert again.warm_start is True and tessera.counters.snapshot()["eager_compiles"] == 0
    assert set(again.report.learnt_sizes) == {(2, 16), (4, 8)}
    served = {label for size, label, _ in again.report.sizes_served if size == (4, 8)}
    assert any(label.startswith("shape ") for label in served), served
