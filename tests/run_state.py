"""A child process for tests/test_grad_and_state.py: one call of a small model under a state.

``python -m tests.run_state autocast|plain`` prints the output's dtype, whether it equals eager,
whether the process started warm and how many graphs it traced.
"""

from __future__ import annotations

import json
import sys

import torch

import tessera


def main() -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()).eval().requires_grad_(False)
    compiled = tessera.compile(model, backend="eager")
    x = torch.randn(4, 16)
    if sys.argv[1] == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, expected = compiled(x), model(x)
    else:
        got, expected = compiled(x), model(x)
    report = {
        "dtype": str(got.dtype),
        "equal": bool(torch.equal(got, expected)),
        "warm": compiled.warm_start,
        "traced": tessera.counters.snapshot()["graphs_traced"],
    }
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
