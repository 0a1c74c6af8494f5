"""torch.compile(model, backend="tessera"): found by name, options checked, cached across processes."""

from __future__ import annotations

import logging

import pytest
import torch

import tessera
from tessera.trace.dynamo_backend import backend_config
from tests.child import run_json
from tests.run_torch_compile import Attention, Branches


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_fresh_process_finds_the_backend_by_name_and_a_second_compiles_nothing(tmp_path, backend):
    cold = run_json("tests.run_torch_compile", backend, cache=tmp_path / "cache")
    assert cold["listed"] and not cold["imported_before_compile"], "found through the entry point"
    # Equal to eager (the child asserts assert_close at every size). Not bit-equal: what serves a
    # call depends on when the background compile lands, and Inductor's tanh may differ in the last bit.
    assert cold["Attention"] < 1e-5 and cold["Branches"] < 1e-5
    breaks = [where for is_break, where in cold["graphs"] if is_break]
    assert breaks and all("run_torch_compile.py" in where for where in breaks), "the branch's line"
    compiled = "inductor_compiles" if backend == "inductor" else "eager_compiles"
    assert cold["counters"][compiled] > 0
    if backend == "inductor":
        warm = run_json("tests.run_torch_compile", backend, cache=tmp_path / "cache")
        assert warm["counters"]["inductor_compiles"] == 0
        assert warm["counters"]["artifacts_loaded"] == cold["counters"]["artifacts_saved"] > 0


def test_options_are_compile_config_fields_checked_the_same_way():
    assert backend_config({"compile_sizes": [8], "backend": "eager"}).compile_sizes == (8,)
    assert backend_config(None, "max-autotune").inductor_config == {"max_autotune": True}
    assert backend_config({"cudagraph_mode": "none"}, "reduce-overhead").cudagraph_mode == "none"
    for options, mode, match in (
        ({"compile_sizes": [0]}, None, ">= 1"),
        ({"sizes": [8]}, None, "unknown CompileConfig field"),
        ({"mode": "stock"}, None, "'piecewise'"),
        ({"fullgraph": True}, None, "torch.compile"),
        ({"prefix": "a/b"}, None, "plain directory name"),
        ({"prefix": "a\\b"}, None, "plain directory name"),  # one check with tessera.compile's
        (None, "fast", "mode='fast'"),
    ):
        with pytest.raises(tessera.ConfigError, match=match):
            backend_config(options, mode)
    # Through torch.compile, at the first call (Dynamo calls the backend then), with our message.
    compiled = torch.compile(Attention().requires_grad_(False), backend="tessera", options={"sizes": [8]})
    with pytest.raises(Exception, match="unknown CompileConfig field"):
        compiled(torch.randn(2, 5, 16))


def test_a_graph_whose_result_needs_gradients_goes_to_torchs_own_backend_with_a_warning():
    model = Attention()  # parameters require grad, grad enabled: a training call
    compiled = torch.compile(model, backend="tessera", options={"backend": "eager"})
    x = torch.randn(2, 5, 16)
    with pytest.warns(tessera.TesseraWarning, match="needs gradients"):
        got = compiled(x)
    expected = model(x)
    torch.testing.assert_close(got, expected)
    assert got.requires_grad
    got.sum().backward()
    assert model.qkv.weight.grad is not None


def test_compile_sizes_specialise_the_one_dynamic_size_and_graphs_with_more_keep_the_general():
    model = Branches().eval().requires_grad_(False)
    options = {"backend": "eager", "compile_sizes": [8], "disable_cache": True}
    marked = torch.compile(model, backend="tessera", options=options)
    for seq in (5, 8, 11):
        x = torch.randn(2, seq, 16)
        torch._dynamo.mark_dynamic(x, 1)
        torch.testing.assert_close(marked(x), model(x))
    counts = tessera.counters.snapshot()
    # Pieces with the marked size get general + size 8; a resumed frame's first graph is static.
    assert counts["compiled_pieces"] < counts["backend_compilations"] < 2 * counts["compiled_pieces"]
    tessera.counters.reset()
    torch._dynamo.reset()
    everything = torch.compile(model, backend="tessera", dynamic=True, options=options)
    with pytest.warns(tessera.TesseraWarning, match="List shapes instead"):
        for batch, seq in ((2, 5), (3, 8)):
            x = torch.randn(batch, seq, 16)
            torch.testing.assert_close(everything(x), model(x))


def test_a_listed_shape_specialises_a_graph_whose_batch_and_length_vary(caplog):
    """torch.compile(dynamic=True): every dim dynamic; a listed (batch, length) shape is compiled
    for the graphs, eager's numbers for every call, the listed shape's and the others'."""
    model = Branches().eval().requires_grad_(False)
    options = {"backend": "eager", "compile_sizes": [(3, 8)], "disable_cache": True}
    compiled = torch.compile(model, backend="tessera", dynamic=True, options=options)
    # The graph after the break takes y, every dim of it dynamic (the hidden one too): a shape
    # of two values fits none of its pieces, and a warning says so.
    with (
        caplog.at_level(logging.INFO, logger="tessera"),
        pytest.warns(tessera.TesseraWarning, match=r"no shape in compile_sizes fits .* varies in 3 dims"),
    ):
        for batch, seq in ((2, 5), (3, 8), (4, 8), (3, 9)):
            x = torch.randn(batch, seq, 16)
            torch.testing.assert_close(compiled(x), model(x))
    assert "shape 3x8 compiled" in caplog.text and "3x8 matched" in caplog.text, caplog.text
