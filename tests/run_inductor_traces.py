"""Subprocess helper: Inductor traces of a size-branching model, first called at size 1 under
inference_mode, compared with eager. Prints "GRAPHS_TRACED INDUCTOR_COMPILES"."""

from __future__ import annotations

import sys

import torch

import tessera


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x.float()).relu()
        return (y * 2 if x.shape[0] > 4 else y - 1).to(x.dtype)


def main() -> int:
    model = Branchy().eval().requires_grad_(False)
    compiled = tessera.compile(model, backend="inductor")
    with torch.inference_mode():
        for x in (torch.randn(1, 8), torch.randn(3, 8), torch.randn(9, 8)):
            torch.testing.assert_close(compiled(x), model(x))
    compiled.wait_ready()
    counts = tessera.counters.snapshot()
    sys.stdout.write(f"{counts['graphs_traced']} {counts['inductor_compiles']}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
