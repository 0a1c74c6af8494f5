"""Benchmarks shipped with the package (``benchmarks/*.py`` and ``tessera bench`` run them)."""
