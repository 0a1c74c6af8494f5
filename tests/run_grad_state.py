"""A child process for tests/test_process_states.py: a small model called under a grad state.

``python -m tests.run_grad_state STATE BACKEND SIZES`` with STATE one of ``inference_mode``,
``no_grad`` (parameters left as made: they require grad) or ``frozen`` (grad enabled, PyTorch's
default, on a model whose parameters do not require grad). Prints, as JSON, the largest difference
from eager over the sizes, whether any output carries a ``grad_fn``, whether the process started
warm, how many graphs it traced and which heavy modules a call imported.
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


def main() -> int:
    state, backend, sizes = sys.argv[1], sys.argv[2], [int(s) for s in sys.argv[3].split(",")]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    if state == "frozen":
        model.requires_grad_(False)
    compiled = tessera.compile(model, backend=backend, compile_sizes=[16])
    inputs = {n: torch.randn(n, 16) for n in sizes}
    with STATES[state]():
        outputs = {n: compiled(x) for n, x in inputs.items()}
    modules = {name: name in sys.modules for name in WATCHED}  # before eager and assert_close
    with STATES[state]():
        expected = {n: model(x) for n, x in inputs.items()}
    report = {
        "error": max(float((outputs[n] - expected[n]).abs().max()) for n in sizes),
        "grad_fn": any(out.grad_fn is not None for out in outputs.values()),
        "warm": compiled.warm_start,
        "traced": tessera.counters.snapshot()["graphs_traced"],
        "modules": modules,
        "refused": compiled.warm_start_refused,
    }
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
