"""A cold process, then a warm one, in every grad state a server runs a model in.

Each state runs in fresh processes, the first as short as a CLI's (one call, then exit): the
second must trace nothing, equal eager at the size seen and at sizes not seen, and, with Inductor,
load its pieces without Dynamo's tracer or Inductor's compile machinery.
"""

from __future__ import annotations

import pytest

from tests.child import run_json

STATES = ("inference_mode", "no_grad", "frozen")


def _cold_then_warm(tmp_path, state: str, backend: str) -> tuple[dict, dict]:
    cache = tmp_path / "cache"
    cold = run_json("tests.run_grad_state", state, backend, "16", cache=cache)
    warm = run_json("tests.run_grad_state", state, backend, "16,7,33", cache=cache)
    return cold, warm


def _check(cold: dict, warm: dict) -> None:
    assert cold["warm"] is False and cold["traced"] == 1, cold
    assert cold["error"] < 1e-5 and not cold["grad_fn"], cold
    assert warm["warm"] is True and warm["traced"] == 0, warm
    assert warm["error"] < 1e-5, warm
    assert not warm["grad_fn"], "an inference result carries no graph for backward"


@pytest.mark.slow
@pytest.mark.parametrize("state", STATES)
def test_cold_then_warm_process_eager_compiler(tmp_path, state):
    _check(*_cold_then_warm(tmp_path, state, "eager"))


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("state", STATES)
def test_cold_then_warm_process_inductor_loads_lean(tmp_path, state):
    cold, warm = _cold_then_warm(tmp_path, state, "inductor")
    _check(cold, warm)
    # Pieces compiled in the background carry their direct code (they were compiled for
    # inference, not for autograd), so the warm process imports no compiler.
    imported = sorted(name for name, present in warm["modules"].items() if present)
    assert imported == [], f"the warm start imported {imported}"
