"""A user-defined compiler for the ``module:Class`` backend test: runs graphs, counts calls."""

from __future__ import annotations

from typing import Any, ClassVar


class CountingCompiler:
    name = "counting"
    compiled: ClassVar[list[Any]] = []

    def compute_hash(self) -> str:
        return "counting-v1"

    def initialize_cache(self, cache_dir: Any) -> None:
        pass

    def compile(self, graph, example_inputs, config, size, key):
        CountingCompiler.compiled.append(size)
        return graph.forward, None

    def load(self, handle, graph, example_inputs, index, size):
        return graph.forward
