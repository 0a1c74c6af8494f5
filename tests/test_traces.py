"""The owner of a model's traces: calls that eager and stock torch.compile serve are served (traced
again where they must be), within max_traces; the next process repeats them with nothing traced;
max_traces=1 refuses them. The cases themselves are in tests/run_traces.py (run in fresh processes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tessera
from tessera import _compat
from tests.child import run_json

# torch 2.11's guards on a convolution do not cover a batch of 1 with the trace of 8 and 16 rows:
# one more trace (1 row) there, one more refusal with max_traces=1. torch 2.13 on: 2 traces. (2.12
# was not run.)
TORCH_2_11 = _compat.torch_release() <= (2, 11)


def test_calls_unlike_the_first_are_traced_again_and_the_next_process_traces_nothing(tmp_path: Path):
    first = run_json("tests.run_traces", "eager", cache=tmp_path)
    # Each case equals eager at every call (asserted in the child); how many traces each needed:
    assert {name: case["traces"] for name, case in first.items()} == {
        "size_branch": 2,  # 4 <= n, then n <= 3 (size 1 included)
        "flag": 2,  # scale=False given later
        "dtype_and_rank": 3,
        "keyword_later": 2,
        "train_after_eval": 2,  # model.training read by the trace
        "conv_batches": 3 if TORCH_2_11 else 2,  # a convolution's bound on the batch (n <= 15), then n >= 16
        "toy_llama": 1,  # 1, 2, 7 and 33 tokens: the model does not treat size 1 apart
    }
    assert "scale" in first["flag"]["reasons"][1] and "dtype" in first["dtype_and_rank"]["reasons"][1]
    # The conv net's two traces have one graph: the second shares the first's pieces (2.11's third,
    # for 1 row, has a graph of its own: the size is static there).
    # Two graphs: the second trace knows other ranges of its sizes, so it shares no pieces.
    assert first["conv_batches"]["graphs_traced"] == 2
    second = run_json("tests.run_traces", "eager", cache=tmp_path)
    for name, case in second.items():
        assert case["graphs_traced"] == 0, name
        assert case["loaded"] == case["traces"] == first[name]["traces"], name


def test_max_traces_1_refuses_every_call_the_first_trace_does_not_cover(tmp_path: Path):
    strict = run_json("tests.run_traces", "eager", "1", cache=tmp_path)
    assert {name: case["refused"] for name, case in strict.items()} == {
        "size_branch": [1, 3, 4],  # 3, 1 and 2 rows: under the bound the branch set
        "flag": [1],
        "dtype_and_rank": [1, 2],
        "keyword_later": [1],
        "train_after_eval": [1],
        "conv_batches": [1, 2, 3] if TORCH_2_11 else [1, 2],  # 16 and 32 rows (and 1 on 2.11)
        "toy_llama": [],
    }


def test_the_refusal_past_the_limit_names_every_trace_and_why():
    compiled = tessera.compile(lambda x, s: x * s, backend="eager", disable_cache=True, max_traces=2)
    x = torch.randn(3)  # grad enabled, as PyTorch starts: nothing here requires grad
    compiled(x, 2.0)
    compiled(x, 3.0)
    with pytest.raises(tessera.InputMismatchError) as raised:
        compiled(x, 4.0)
    message = str(raised.value)
    assert "2 trace(s), the limit (trace 1: the first call; trace 2: s: value" in message
    assert "raise max_traces (now 2)" in message
    torch.testing.assert_close(compiled(x, 2.0), x * 2.0)  # the traces made still serve


def squeezes(x: torch.Tensor) -> torch.Tensor:
    return x.squeeze(0) + 1


def branches_on_query_length(x: torch.Tensor) -> torch.Tensor:
    return x.softmax(-1) if x.shape[1] > 1 else x * 2  # as transformers' `q_length > 1`


@pytest.mark.parametrize("fn", [squeezes, branches_on_query_length])
def test_a_model_that_treats_size_one_apart_gets_one_more_trace_for_it(fn):
    compiled = tessera.compile(fn, backend="eager", disable_cache=True, dynamic_dims={"x": (0, 1)})
    for shape in ((3, 4), (5, 2), (1, 4), (2, 1), (1, 1), (6, 6)):
        x = torch.randn(*shape)
        torch.testing.assert_close(compiled(x), fn(x), msg=f"{fn.__name__} at {shape}")
    assert len(compiled.traces) <= 3  # the general one, and one per dim that is 1 where it matters
    assert len(compiled.traces) >= 2


@pytest.mark.inductor
def test_inductor_size_one_and_other_traces_cold_and_warm(tmp_path: Path):
    """Inductor: a first call at size 1, then the other side of a size branch; the next process
    starts from the saved traces (nothing traced, nothing compiled) under inference_mode."""
    from tests.child import run_module

    for attempt in ("cold", "warm"):
        proc = run_module("tests.run_inductor_traces", cache=tmp_path)
        report = proc.stdout.strip().splitlines()[-1]
        traced, compiled = (int(v) for v in report.split())
        if attempt == "cold":
            assert traced >= 2 and compiled >= 2, report
        else:
            assert (traced, compiled) == (0, 0), report
