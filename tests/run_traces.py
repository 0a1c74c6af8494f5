"""Subprocess helper: calls that need more than one trace, as users make them, compared with eager.

Usage: python -m tests.run_traces BACKEND [MAX_TRACES]
Each case compiles a model with tessera's defaults and makes its calls (grad enabled, parameters
frozen); every output must equal eager's. Prints JSON: per case, the traces the model holds, how
many were loaded from an earlier process, and the graphs this process traced; with MAX_TRACES=1,
which calls were refused (a TesseraError) instead.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

import tessera
from tessera.models import toy_llama


class SizeBranch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] > 3 else x - 1


class Flag(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: bool = True) -> torch.Tensor:
        return x * 2 if scale else x + 1


class Mode(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.training else x * 3


class Keyword(torch.nn.Module):
    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return x * 2 if bias is None else x * 2 + bias


def conv_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, 4),
    ).eval()


def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


def cases() -> dict[str, tuple[torch.nn.Module, list[Callable[[], tuple[tuple[Any, ...], dict[str, Any]]]]]]:
    mode = Mode().eval()
    return {
        "size_branch": (SizeBranch(), [lambda n=n: ((r(n, 3),), {}) for n in (4, 3, 6, 1, 2)]),
        "flag": (
            Flag(),
            [lambda: ((r(4, 3),), {}), lambda: ((r(4, 3),), {"scale": False}), lambda: ((r(5, 3), True), {})],
        ),
        "dtype_and_rank": (
            Flag(),
            [
                lambda: ((r(4, 3),), {}),
                lambda: ((r(4, 3, dtype=torch.float64),), {}),
                lambda: ((r(2, 4, 3),), {}),
            ],
        ),
        "keyword_later": (
            Keyword(),
            [lambda: ((r(4, 3),), {}), lambda: ((r(4, 3),), {"bias": r(3)}), lambda: ((r(6, 3),), {})],
        ),
        "train_after_eval": (
            mode,
            [
                lambda: ((r(4, 3),), {}),
                lambda: (mode.train() and (r(4, 3),), {}),
                lambda: (mode.eval() and (r(5, 3),), {}),
            ],
        ),
        "conv_batches": (
            conv_net(),
            [
                lambda n=n, cl=cl: (
                    (r(n, 3, 8, 8).to(memory_format=torch.channels_last if cl else torch.contiguous_format),),
                    {},
                )
                for n, cl in ((8, False), (16, False), (32, True), (1, False), (3, True))
            ],
        ),
        "toy_llama": (
            toy_llama.build(num_layers=1),
            [lambda n=n: (toy_llama.example_inputs(n), {}) for n in (1, 2, 7, 33)],
        ),
    }


def main() -> int:
    backend = sys.argv[1]
    max_traces = int(sys.argv[2]) if len(sys.argv) > 2 else None
    options = {} if max_traces is None else {"max_traces": max_traces}
    out: dict[str, Any] = {}
    for name, (model, calls) in cases().items():
        model.requires_grad_(False)
        compiled = tessera.compile(model, backend=backend, prefix=name, **options)
        tessera.counters.reset()
        refused = []
        for i, make in enumerate(calls):
            args, kwargs = make()
            expected = model(*args, **kwargs)
            try:
                got = compiled(*args, **kwargs)
            except tessera.TesseraError:
                refused.append(i)
                continue
            torch.testing.assert_close(got, expected, msg=lambda m, name=name, i=i: f"{name} call {i}: {m}")
        compiled.wait_ready()
        out[name] = {
            "traces": len(compiled.traces),
            "loaded": sum(e.loaded for e in compiled.traces),
            "graphs_traced": tessera.counters.snapshot().get("graphs_traced", 0),
            "refused": refused,
            "reasons": [e.reason for e in compiled.traces],
        }
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
