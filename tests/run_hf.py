"""Subprocess helper: greedy generation with a small Hugging Face model under tessera.

Usage: python -m tests.run_hf FAMILY BACKEND OUT.pt
Two prompts of different lengths go through prefill (sequence length dynamic) and 8 decode steps
each (StaticCache, static shapes). Tokens (and eager's) are saved to OUT.pt; counters and which heavy modules
the process imported are printed as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import transformers

import tessera
from tessera import hf
from tests.run_toy import HEAVY_MODULES
from tests.test_hf import build


def main() -> int:
    family, backend, out = sys.argv[1:4]
    model, config = build(family)
    prefill = hf.compile_causal_lm(model, backend=backend, prefix="prefill")
    decode = hf.compile_causal_lm(model, backend=backend, prefix="decode", dynamic_sequence=False)
    tokens, expected = {}, {}
    prompts = {n: torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 14)}
    for length, prompt in prompts.items():
        cache = transformers.StaticCache(config=config, max_cache_len=64)
        tokens[length] = hf.greedy_generate(prefill, decode, prompt, cache, 8)
    counters = tessera.counters.snapshot()
    for length, prompt in prompts.items():
        cache = transformers.StaticCache(config=config, max_cache_len=64)
        expected[length] = hf.greedy_generate(model, model, prompt, cache, 8)
    torch.save({"tokens": tokens, "eager": expected}, out)
    report = {
        "counters": counters,
        "warm_start": [prefill.warm_start, decode.warm_start],
        "modules": {name: name in sys.modules for name in HEAVY_MODULES},
    }
    json.dump(report, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
