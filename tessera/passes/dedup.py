"""``DeduplicatePass``: computes each pure expression once (common subexpression elimination).

Models recompute the same thing in several places: the toy Llama gathers the rotary cos/sin
table for the queries and again for the keys of every layer. After Inductor's own post-grad
passes, a node that calls the same functional op on the same inputs as an earlier node is
replaced by that node. Ops that mutate, allocate, draw random numbers or have side effects are
never merged, nor is anything a mutating op reads or writes.
"""

from __future__ import annotations

import hashlib
import operator
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera import _compat

_NEVER = ("empty", "new_empty", "empty_strided", "rand", "randn", "randint", "bernoulli", "dropout")


class DeduplicatePass:
    """Merge nodes computing the same functional op on the same arguments."""

    def __init__(self) -> None:
        self.removed = 0  # nodes removed, summed over every graph this instance has seen

    def uuid(self) -> str:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        touched = _mutated_or_mutating(graph)
        seen: dict[Any, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if not _mergeable(node) or node in touched:
                continue
            key = (node.target, _freeze(node.args), _freeze(node.kwargs))
            try:
                hash(key)
            except TypeError:
                continue
            earlier = seen.get(key)
            if earlier is None:
                seen[key] = node
                continue
            if earlier.meta.get("val") is not None and node.meta.get("val") is not None:
                a, b = earlier.meta["val"], node.meta["val"]
                if isinstance(a, torch.Tensor) and (a.dtype != b.dtype or a.stride() != b.stride()):
                    continue  # same call, other layout: keep both (downstream kernels assume it)
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
            self.removed += 1


def _mergeable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, _compat.OpOverload):
        return False
    if _compat.op_is_mutable(node.target):
        return False
    if any(name in _compat.op_schema_name(node.target) for name in _NEVER):
        return False
    return torch.Tag.nondeterministic_seeded not in node.target.tags


def _mutated_or_mutating(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes a mutating op writes or reads, and the mutating ops themselves: never merged."""
    out: set[torch.fx.Node] = set()
    for node in graph.nodes:
        target = node.target
        mutating = node.op == "call_function" and (
            (not isinstance(target, _compat.OpOverload) and target is not operator.getitem)
            or (isinstance(target, _compat.OpOverload) and _compat.op_is_mutable(target))
        )
        if mutating:
            out.add(node)
            out.update(n for n in node.all_input_nodes)
    return out


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_freeze(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, torch.fx.Node):
        return ("node", id(value))
    return value
