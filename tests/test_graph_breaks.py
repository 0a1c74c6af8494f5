"""tessera.compile on models Dynamo cannot trace as one graph: run as torch.compile would, with
every graph cut, compiled per size and cached by tessera; the breaks named once, and in the report."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

import tessera
from tests.child import run_json
from tests.run_torch_compile import Attention


class Breaks(Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if y.mean() > 0:  # data-dependent branch: a graph break
            y = y.relu()
        y = y + 1  # work before the print on both branches: a graph that ends at the print
        print("logged")  # noqa: T201  (a side effect Dynamo cannot put in a graph: another break)
        return torch.ops.silly.attention(y, y, y) * 2


def line_of(text: str) -> int:
    lines, first = inspect.getsourcelines(Breaks.forward)
    return first + next(i for i, line in enumerate(lines) if text in line)


BRANCH, PRINT = line_of("if y.mean()"), line_of("print(")


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_model_with_graph_breaks_equals_eager_and_its_breaks_are_named(backend, capsys):
    model = Breaks().eval().requires_grad_(False)  # grad stays enabled, as in a user's process
    compiled = tessera.compile(model, backend=backend, dynamic_dims={"x": 1}, compile_sizes=[8])
    x = torch.randn(2, 5, 16)
    with pytest.warns(
        tessera.TesseraWarning, match=rf"graph breaks.*test_graph_breaks\.py:{BRANCH} in forward"
    ):
        torch.testing.assert_close(compiled(x), model(x))
    for seq, sign in ((8, 1), (9, -1), (1, 1), (5, -1), (16, 1)):
        x = torch.randn(2, seq, 16) * sign
        torch.testing.assert_close(compiled(x), model(x), msg=f"sequence {seq}")
    assert capsys.readouterr().out.count("logged") == 12, "the print runs on every call, as in eager"
    report = compiled.report
    assert report is not None and report.graphs
    lines = {g.source.rsplit("/", 1)[-1] for g in report.graphs if g.graph_break}
    assert lines == {f"test_graph_breaks.py:{BRANCH} in forward", f"test_graph_breaks.py:{PRINT} in forward"}
    assert "graph breaks" in report.summary() and report.as_dict()["graphs"]
    assert all(a.piece.startswith("graph ") for a in report.artifacts)
    assert compiled.cache_dir is not None and compiled.cache_dir.is_dir()
    # `tessera report` on the entry shows each graph, its break and line.
    shown = subprocess.run(
        [sys.executable, "-m", "tessera", "report", str(compiled.cache_dir)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout
    assert "graph break" in shown and f"test_graph_breaks.py:{BRANCH}" in shown, shown
    # The next start goes to the guarded path at once: no one-graph trace to fail again.
    again = tessera.compile(model, backend=backend, dynamic_dims={"x": 1}, compile_sizes=[8])
    with pytest.warns(tessera.TesseraWarning, match="graph breaks"):
        torch.testing.assert_close(again(x), model(x))
    assert again.warm_start_refused is not None and "guarded path" in again.warm_start_refused
    # Still an inference compile: a call whose result needs gradients is refused.
    with pytest.raises(tessera.GradientsNotSupportedError):
        compiled(torch.randn(2, 5, 16, requires_grad=True))


def test_fullgraph_true_refuses_a_model_with_graph_breaks():
    compiled = tessera.compile(Breaks().requires_grad_(False), backend="eager", fullgraph=True)
    with pytest.raises(tessera.UnsupportedModelError, match=rf"test_graph_breaks\.py:{BRANCH}"):
        compiled(torch.randn(2, 5, 16))


@pytest.mark.inductor
def test_a_warm_process_compiles_nothing_on_the_guarded_path(tmp_path):
    cold = run_json("tests.run_torch_compile", "inductor", "--tessera-compile", cache=tmp_path / "cache")
    warm = run_json("tests.run_torch_compile", "inductor", "--tessera-compile", cache=tmp_path / "cache")
    assert max(cold["Branches"], warm["Branches"]) < 1e-5  # assert_close passed in both
    assert cold["counters"]["inductor_compiles"] > 0
    assert warm["counters"]["inductor_compiles"] == 0
    guarded = warm["reports"][1]
    assert guarded["kind"] == "warm" and any(g["graph_break"] for g in guarded["graphs"])
    assert all(a["source"] == "loaded" for a in guarded["artifacts"])


def test_the_report_shows_a_break_s_file_and_line_however_deep_its_path(monkeypatch, tmp_path):
    from tessera.cli.report import short_source

    deep = "/" + "/".join(["a_rather_long_directory_name"] * 8) + "/pkg/model.py:22 in forward"
    assert short_source(deep) == "pkg/model.py:22 in forward"
    monkeypatch.chdir(tmp_path)
    assert short_source(f"{tmp_path}/src/model.py:7 in f") == "src/model.py:7 in f"
    assert short_source("<eval_with_key>.3:5 in forward") == "<eval_with_key>.3:5 in forward"


class Checked(torch.nn.Module):
    """A data-dependent ``raise`` (a graph break) between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if bool((h.abs() > 1e6).any()):
            raise ValueError("overflow")
        return self.b(torch.relu(h))


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_after_wait_ready_a_call_of_another_size_compiles_nothing_on_the_guarded_path(backend, tmp_path):
    from torch._dynamo.utils import counters as dynamo_counters

    torch._dynamo.reset()
    model = Checked().eval().requires_grad_(False)  # an inference model, called with grad enabled
    compiled = tessera.compile(model, backend=backend, cache_dir=str(tmp_path))
    first = torch.randn(16, 4).t()  # a layout of the caller's: every call below has it too
    with pytest.warns(tessera.TesseraWarning, match="graph breaks"):
        out = compiled(first)
    torch.testing.assert_close(out, model(first))
    assert compiled.wait_ready(60)
    frames, graphs = dict(dynamo_counters["frames"]), len(tessera.trace.receiver.graphs())
    for n in (3, 5, 9, 17):
        x = torch.randn(16, n).t()
        out = compiled(x)
        torch.testing.assert_close(out, model(x))
        # The frame resumed after the break was traced with the batch dynamic, as the first.
        assert dict(dynamo_counters["frames"]) == frames, n
        assert len(tessera.trace.receiver.graphs()) == graphs, n
        assert not any(name.startswith("_dynamo") for name in out.__dict__)  # no mark left
