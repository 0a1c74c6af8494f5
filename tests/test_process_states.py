"""A cold process, then a warm one, in every grad state a server runs a model in.

Each state runs in fresh processes, the first as short as a CLI's (one call, then exit): the
second must trace nothing, equal eager at the size seen and at sizes not seen, and, with Inductor,
load its pieces without Dynamo's tracer or Inductor's compile machinery.
"""

from __future__ import annotations

import pytest

from tests.child import run_json

STATES = ("inference_mode", "no_grad", "frozen")


def _cold_then_warm(tmp_path, backend: str) -> tuple[dict, dict]:
    cache = tmp_path / "cache"
    cold = run_json("tests.run_grad_state", backend, "16", cache=cache)
    warm = run_json("tests.run_grad_state", backend, "16,7,33", cache=cache)  # 7, 33: not seen
    assert sorted(cold["states"]) == sorted(warm["states"]) == sorted(STATES)
    assert cold["traced"] == len(STATES), cold
    assert warm["traced"] == 0, warm
    for state in STATES:
        first, second = cold["states"][state], warm["states"][state]
        assert first["warm"] is False and first["error"] < 1e-5 and not first["grad_fn"], (state, first)
        assert second["warm"] is True and second["error"] < 1e-5, (state, second)
        assert not second["grad_fn"], f"{state}: an inference result carries no graph for backward"
    return cold, warm


@pytest.mark.slow
def test_cold_then_warm_process_in_every_grad_state_eager_compiler(tmp_path):
    _cold_then_warm(tmp_path, "eager")


@pytest.mark.slow
@pytest.mark.inductor
def test_cold_then_warm_process_in_every_grad_state_inductor_loads_lean(tmp_path):
    _, warm = _cold_then_warm(tmp_path, "inductor")
    # Pieces compiled in the background carry their direct code (they were compiled for
    # inference, not for autograd), so the warm process imports no compiler.
    imported = sorted(name for name, present in warm["modules"].items() if present)
    assert imported == [], f"the warm start imported {imported}"
