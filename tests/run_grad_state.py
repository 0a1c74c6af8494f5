"""A child process for tests/test_process_states.py: a small model called under a grad state.

``python -m tests.run_grad_state BACKEND SIZES`` calls one model per state: ``inference_mode``,
``no_grad`` (parameters left as made: they require grad) and ``frozen`` (grad enabled, PyTorch's
default, on a model whose parameters do not require grad); one process for all three, since each
Inductor process pays Inductor's set-up. Prints, as JSON, per state the largest difference from
eager over the sizes, whether any output carries a ``grad_fn`` and whether the model started
warm; how many graphs the process traced and which heavy modules it imported.
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch

import tessera
from tests.run_toy import HEAVY_MODULES

STATES = {
    "inference_mode": torch.inference_mode,
    "no_grad": torch.no_grad,
    "frozen": contextlib.nullcontext,
}
# The warm lean path loads neither Dynamo's tracer nor Inductor's compile machinery.
WATCHED = (*HEAVY_MODULES, "torch._dynamo.convert_frame", "torch._inductor.compile_fx")


def run_state(state: str, width: int, backend: str, sizes: list[int]) -> dict[str, object]:
    """One model (its own width: a model of its own in the cache) called under ``state``."""
    torch.manual_seed(width)
    model = torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 8))
    if state == "frozen":
        model.requires_grad_(False)
    compiled = tessera.compile(model, backend=backend, compile_sizes=[16], prefix=state)
    inputs = {n: torch.randn(n, 16) for n in sizes}
    with STATES[state]():
        outputs = {n: compiled(x) for n, x in inputs.items()}
        expected = {n: model(x) for n, x in inputs.items()}
    return {
        "error": max(float((outputs[n] - expected[n]).abs().max()) for n in sizes),
        "grad_fn": any(out.grad_fn is not None for out in outputs.values()),
        "warm": compiled.warm_start,
        "refused": compiled.warm_start_refused,
    }


def main() -> int:
    backend, sizes = sys.argv[1], [int(s) for s in sys.argv[2].split(",")]
    reports = {state: run_state(state, 24 + 8 * i, backend, sizes) for i, state in enumerate(STATES)}
    report = {
        "states": reports,
        "traced": tessera.counters.snapshot()["graphs_traced"],
        # Read before anything else imports them (assert_close imports torch.distributed).
        "modules": {name: name in sys.modules for name in WATCHED},
    }
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
