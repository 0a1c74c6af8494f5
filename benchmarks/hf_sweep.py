"""The causal-LM catalogue under eager, stock torch.compile and tessera; prints JSON.

Run: ``python benchmarks/hf_sweep.py [--families llama qwen2] [--timeout 180]`` (needs ``.[hf]``).
"""

from __future__ import annotations

from tessera.cli.bench.hf_sweep import main

if __name__ == "__main__":
    raise SystemExit(main())
