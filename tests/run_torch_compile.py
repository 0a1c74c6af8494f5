"""Subprocess helper: torch.compile(model, backend="tessera") in a process that does not import
tessera before compiling (Dynamo finds the backend through its entry point).

Usage: python -m tests.run_torch_compile BACKEND [--tessera-compile]
BACKEND: tessera's compiler (eager or inductor). --tessera-compile: tessera.compile instead (a
model with graph breaks takes the guarded path there).
Prints one JSON line: whether "tessera" is a listed backend, whether the user code imported
tessera, the largest difference from eager per model, and tessera's counters.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.nn.functional as F


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)) + x


class Branches(Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if y.mean() > 0:  # data-dependent: a graph break, two graphs
            return y.relu()
        return y.tanh()


def main() -> int:
    listed = "tessera" in torch._dynamo.list_backends()
    imported_before = "tessera" in sys.modules
    torch.manual_seed(0)
    report: dict[str, Any] = {"listed": listed, "imported_before_compile": imported_before}
    sizes = ((2, 5), (2, 9), (3, 16), (1, 7), (2, 5))
    reports = []
    for model in (Attention().eval(), Branches().eval()):
        model.requires_grad_(False)
        if "--tessera-compile" in sys.argv:
            import tessera

            compiled = tessera.compile(model, backend=sys.argv[1], dynamic_dims={"x": 1})
            sizes = ((2, 5), (2, 9), (2, 16), (2, 1), (2, 5))  # one dynamic dim: the sequence
        else:
            compiled = torch.compile(model, backend="tessera", dynamic=True, options={"backend": sys.argv[1]})
        worst = 0.0
        for batch, seq in sizes:
            x = torch.randn(batch, seq, 16) * (1 if seq != 9 else -1)  # both branches of Branches
            got, expected = compiled(x), model(x)  # grad enabled, parameters frozen
            torch.testing.assert_close(got, expected)
            worst = max(worst, (got - expected).abs().max().item())
        report[type(model).__name__] = worst
        reports.append(getattr(compiled, "report", None))
    import tessera  # after the calls: the counters of the tessera the entry point loaded

    report["counters"] = tessera.counters.snapshot()
    report["graphs"] = [(g.graph_break, g.source.rsplit("/", 1)[-1]) for g in tessera.dynamo_backend.graphs()]
    report["reports"] = [r.as_dict() if r is not None else None for r in reports]
    print(json.dumps(report))  # noqa: T201  (the parent reads this line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
