"""A background compile shares the process with other compiles: none disturbs another.

A server runs a main and a draft model, or tessera beside the user's own ``torch.compile``: model
A's sizes compile in the background while B (stock ``torch.compile``) compiles and runs, C (another
tessera model) traces, and D (graph breaks: the guarded path) traces graph after graph.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tessera


def _mlp(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 16))


class _Breaks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _mlp(24), _mlp(40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.first(x)
        torch._dynamo.graph_break()
        return self.second(y).softmax(-1)


@pytest.mark.slow
@pytest.mark.inductor
def test_a_background_compile_beside_stock_torch_compile_and_other_tessera_models():
    torch.manual_seed(0)
    models = [m.requires_grad_(False) for m in (_mlp(32), _mlp(64), _mlp(48), _Breaks())]
    background = {"backend": "inductor", "background_compile": True}
    a = tessera.compile(models[0], compile_sizes=[16, 32], compile_ranges=[8], **background)
    b = torch.compile(models[1], dynamic=True)
    c = tessera.compile(models[2], compile_sizes=[24], **background)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tessera.TesseraWarning)  # D's graph break is said once
        d = tessera.compile(models[3], compile_sizes=[16], **background)
        for _ in range(3):
            for n in (16, 7, 33, 24, 5):
                x = torch.randn(n, 16)
                for compiled, eager in zip((a, b, c, d), models, strict=True):
                    torch.testing.assert_close(compiled(x), eager(x), msg=f"{n} rows")
    assert a.wait_ready(600) and c.wait_ready(600) and d.wait_ready(600)
    for model in (a, c):
        assert model.report is not None and model.report.background == "done", model.report.background
    for n in (16, 32, 7, 24, 40):  # every size in place: still eager's numbers
        x = torch.randn(n, 16)
        for compiled, eager in zip((a, b, c, d), models, strict=True):
            torch.testing.assert_close(compiled(x), eager(x), msg=f"{n} rows, ready")
