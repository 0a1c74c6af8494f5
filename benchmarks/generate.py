"""Tokens per second of ``model.generate()`` for eager, stock torch.compile and tessera; prints JSON.

Run: ``python benchmarks/generate.py [--quick]`` (needs ``pip install -e .[hf]``).
"""

from __future__ import annotations

from tessera.cli.bench.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
