"""Subprocess helper for tests/test_settled.py: a settled process on tessera's defaults.

Usage: python -m tests.run_settled SCENARIO [--workers N]    (also run as a script, under
``python -m cProfile`` or ``python -m trace``)

Scenarios (each prints one JSON line; the models are defined here, in the script):
- ``profiled``: a model whose forward reads a global and calls a helper of this script, called at
  three sizes, then ``wait_ready()`` and the same sizes again: equal to eager, and counters.
- ``custom_op``: a model with a ``torch.library.custom_op`` of this script inside a piece, on
  Inductor with ``compile_sizes=[8]``: equal to eager, the seconds until every size is ready.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import tessera

START = time.perf_counter()
SCALE = 3.0  # read by the model's forward: a global of this script


def shifted(x: torch.Tensor) -> torch.Tensor:
    """A helper of this script, called by the model's forward."""
    return x + 1.0


class Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return shifted(torch.relu(self.proj(x))) * SCALE


@torch.library.custom_op("tessera_test::gelu2", mutates_args=())
def gelu2(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x) * 2.0


@gelu2.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class WithCustomOp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gelu2(self.up(x)))


def _compare(model: torch.nn.Module, compiled: tessera.CompiledModel, sizes: tuple[int, ...]) -> list[bool]:
    equal = []
    for n in sizes:
        x = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            equal.append(bool(torch.allclose(compiled(x), model(x), atol=1e-5, rtol=1e-4)))
    return equal


def profiled() -> dict[str, object]:
    torch.manual_seed(0)
    model = Scripted().eval()
    compiled = tessera.compile(model)
    equal = _compare(model, compiled, (3, 5, 9))
    ready = compiled.wait_ready(600)
    equal += _compare(model, compiled, (3, 5, 9))
    return {"equal": equal, "ready": ready, "counters": tessera.counters.snapshot()}


def custom_op(workers: int | None) -> dict[str, object]:
    torch.manual_seed(0)
    model = WithCustomOp().eval()
    options = {} if workers is None else {"compile_workers": workers}
    compiled = tessera.compile(model, compile_sizes=[8], **options)
    equal = _compare(model, compiled, (8, 5))
    ready = compiled.wait_ready(600)
    ready_s = time.perf_counter() - START
    equal += _compare(model, compiled, (8, 5, 11))
    return {"equal": equal, "ready": ready, "ready_s": ready_s, "counters": tessera.counters.snapshot()}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["profiled", "custom_op"])
    parser.add_argument("--workers", type=int, default=None)
    options = parser.parse_args()
    result = profiled() if options.scenario == "profiled" else custom_op(options.workers)
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
