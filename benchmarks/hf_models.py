"""Hugging Face families under tessera vs eager and stock torch.compile; prints JSON.

Run: ``python benchmarks/hf_models.py [--families llama gpt2]`` (needs ``pip install -e .[hf]``).
"""

from __future__ import annotations

from tessera.cli.bench.hf_models import main

if __name__ == "__main__":
    raise SystemExit(main())
