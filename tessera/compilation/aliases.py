"""Outputs that are views of inputs stay views of those inputs after compilation.

Inductor returns fresh tensors for outputs that eager returns as views of an argument
(``x.add_(1); return x.view(-1)``): a write through the output would then miss the argument.
Stock ``torch.compile`` regenerates such views in AOTAutograd's runtime wrapper; tessera runs the
compiled code without that wrapper, so the split module replays the view ops itself, on the real
argument, after the pieces ran (the replay is part of the split module, so a warm start keeps it).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.fx

from tessera import _compat
from tessera.errors import UnsupportedModelError

log = logging.getLogger(__name__)

# ``x += 1`` reaches the graph as these: in place, returning their first argument.
_INPLACE_OPERATORS = frozenset(
    {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.ipow}
)
_MAX_CHAIN = 32  # view ops replayed per output, at most: a longer chain is refused, not replayed


def _example(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def _writes_in_place(node: torch.fx.Node) -> bool:
    if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return node.op in ("call_function", "call_method") and name.endswith("_") and not name.endswith("__")


def input_aliases(gm: torch.fx.GraphModule) -> list[tuple[int, torch.fx.Node]]:
    """(output position, node) for every graph output that shares storage with a graph input."""
    inputs = [
        value
        for node in gm.graph.nodes
        if node.op == "placeholder" and isinstance(value := _example(node), torch.Tensor)
    ]
    output = next(iter(reversed(gm.graph.nodes)))
    returned = output.args[0]
    flat = returned if isinstance(returned, (tuple, list)) else [returned]
    found = []
    for position, node in enumerate(flat):
        value = _example(node)
        if not isinstance(value, torch.Tensor) or node.op == "placeholder":
            continue  # an input returned as is is passed through by the bytecode, not the graph
        if any(_compat.same_storage(value, source) for source in inputs):
            found.append((position, node))
    return found


def replay_input_aliases(gm: torch.fx.GraphModule, split_gm: torch.fx.GraphModule) -> int:
    """Make each output of ``split_gm`` that aliases an input in ``gm`` (Dynamo's graph) a replay
    of its view ops on the real input. Returns how many outputs were rewired.

    Raises UnsupportedModelError naming the output when the view cannot be replayed cheaply
    (it depends on a computed tensor, or on a chain longer than _MAX_CHAIN).
    """
    aliases = input_aliases(gm)
    if not aliases:
        return 0
    placeholders = {n.target: n for n in split_gm.graph.nodes if n.op == "placeholder"}
    split_output = next(iter(reversed(split_gm.graph.nodes)))
    copied: dict[torch.fx.Node, Any] = {}

    def copy(node: Any, output: int, depth: int) -> Any:
        if not isinstance(node, torch.fx.Node):
            return node
        if node in copied:
            return copied[node]
        if depth > _MAX_CHAIN:
            raise _refusal(output, "its chain of view ops is too long to replay")
        if node.op == "placeholder":
            new: Any = placeholders[node.target]
        elif _writes_in_place(node):
            # The compiled graph already wrote; the replay only needs what the op returned: its input.
            new = copy(node.args[0], output, depth + 1)
        elif node.op in ("call_function", "call_method"):
            value = _example(node)
            if isinstance(value, torch.Tensor) and not _views_an_input(value, gm):
                raise _refusal(output, f"it depends on a computed tensor ({node.name})")
            with split_gm.graph.inserting_before(split_output):
                new = split_gm.graph.node_copy(node, lambda n: copy(n, output, depth + 1))
        else:
            raise _refusal(output, f"it reads {node.op} {node.target}")
        copied[node] = new
        return new

    returned = split_output.args[0]
    flat = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    for position, node in aliases:
        flat[position] = copy(node, position, 0)
    split_output.args = (type(returned)(flat) if isinstance(returned, (tuple, list)) else flat[0],)
    split_gm.graph.lint()
    split_gm.recompile()
    log.debug("%d output(s) replayed as views of their inputs", len(aliases))
    return len(aliases)


def _views_an_input(value: torch.Tensor, gm: torch.fx.GraphModule) -> bool:
    return any(
        isinstance(source := _example(n), torch.Tensor) and _compat.same_storage(value, source)
        for n in gm.graph.nodes
        if n.op == "placeholder"
    )


def _refusal(output: int, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"output {output} of the traced graph is a view of an input in eager, and tessera cannot keep "
        f"it one: {why}. Return a copy (out.clone()) if the caller does not write through it, or "
        "use mode='stock'"
    )
