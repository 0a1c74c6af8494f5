"""Subprocess helper: ``model.generate()`` under ``hf.compile_for_generate``, cold or warm.

Usage: python -m tests.run_generate FAMILY BACKEND CACHE OUT.pt [idiom]   (CACHE: dynamic or static;
idiom: ``model.forward = tessera.compile(model.forward)`` instead of the preset)
Greedy generation of two prompts; tokens (and eager's) go to OUT.pt; counters, whether each compiled
model started warm, and how many calls compiled code served are printed as JSON.
"""

from __future__ import annotations

import json
import sys

import torch

import tessera
from tessera import hf
from tests.test_hf import build, compiled_calls


def main() -> int:
    family, backend, cache, out = sys.argv[1:5]
    idiom = sys.argv[5:6] == ["idiom"]
    model, _ = build(family)
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        options["cache_implementation"] = "static"
    prompts = [torch.randint(1, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14)]
    expected = [model.generate(p, **options) for p in prompts]
    if idiom:
        compiled = tessera.compile(model.forward, backend=backend)
        model.forward = compiled
        models = [compiled]
    else:
        models = hf.compile_for_generate(model, backend=backend).models
    tokens = [model.generate(p, **options) for p in prompts]
    report = {
        "counters": tessera.counters.snapshot(),
        "warm_start": sorted({bool(m.warm_start) for m in models}),
        "refused": [m.warm_start_refused for m in models],
        "artifact": [m.report.as_dict()["whole_model_artifact"] for m in models if m.report],
        "served": sum(compiled_calls(m) for m in models),
        "traces": sum(len(m.traces) for m in models),
    }
    torch.save({"tokens": tokens, "eager": expected}, out)
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
