"""Cutting a traced graph at splitting ops (attention and friends) into ordered pieces.

Owns the matching of op specs to FX nodes and the call to ``split_module``.
"""

from __future__ import annotations

import importlib
import logging
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from tessera._compat import op_overload_name, op_schema_name, packet_name
from tessera.config import SplittingOp
from tessera.errors import ConfigError

log = logging.getLogger(__name__)

ATTENTION_OPS = ("tessera::attention", "tessera::decode_attention")


def default_splitting_ops() -> tuple[SplittingOp, ...]:
    """Attention as unmodified models call it, and tessera's own attention ops."""
    return (torch.nn.functional.scaled_dot_product_attention, *ATTENTION_OPS)


@dataclass(frozen=True)
class SplitItem:
    """One piece of the split graph: its submodule name, order, and whether it is a cut."""

    name: str
    index: int
    is_splitting: bool
    graph: torch.fx.GraphModule


def _resolve_dotted(spec: str) -> object:
    module_name, _, attr = spec.rpartition(".")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"splitting op {spec!r}: cannot import {module_name!r}") from e
    try:
        return getattr(obj, attr)
    except AttributeError as e:
        raise ConfigError(f"splitting op {spec!r}: {module_name} has no {attr!r}") from e


def make_matcher(specs: Sequence[SplittingOp]) -> Callable[[torch.fx.Node], bool]:
    """A predicate telling whether a node calls one of ``specs``.

    ``"ns::op"`` matches every overload of the op, ``"ns::op.overload"`` only that one (a call to
    the packet counts as ``.default``); other specs match by identity of the call target.
    """
    packet_names: set[str] = set()
    overload_names: set[str] = set()
    targets: list[object] = []
    for spec in specs:
        if isinstance(spec, str) and "::" in spec:
            (overload_names if "." in spec.split("::", 1)[1] else packet_names).add(spec)
        elif isinstance(spec, str):
            targets.append(_resolve_dotted(spec))
        elif isinstance(spec, torch._ops.OpOverloadPacket):
            packet_names.add(packet_name(spec))
        elif isinstance(spec, torch._ops.OpOverload):
            overload_names.add(op_overload_name(spec))
        elif callable(spec):
            targets.append(spec)
        else:
            raise ConfigError(f"splitting op {spec!r} is not an op name ('ns::op'), an op or a callable")

    def matches(node: torch.fx.Node) -> bool:
        if node.op != "call_function":
            return False
        target = node.target
        if isinstance(target, torch._ops.OpOverloadPacket):
            name = packet_name(target)
            return name in packet_names or f"{name}.default" in overload_names
        if isinstance(target, torch._ops.OpOverload):
            return op_schema_name(target) in packet_names or op_overload_name(target) in overload_names
        return any(target is t for t in targets)

    return matches


def split_graph(
    gm: torch.fx.GraphModule, specs: Sequence[SplittingOp]
) -> tuple[torch.fx.GraphModule, list[SplitItem]]:
    """Cut ``gm`` before and after every splitting-op node; return the split module and pieces.

    A ``getitem`` on a node's result stays in that node's piece so that no piece takes a whole
    tuple as input. Original node order is kept: reordering breaks graphs with in-place mutation.
    """
    matches = make_matcher(specs)
    piece_of: dict[torch.fx.Node, int] = {}
    splitting_ids: set[int] = set()
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        source = node.args[0] if node.args else None
        if (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(source, torch.fx.Node)
            and source in piece_of
        ):
            piece_of[node] = piece_of[source]
        elif matches(node):
            current += 1
            piece_of[node] = current
            splitting_ids.add(current)
            current += 1
        else:
            piece_of[node] = current
    log.debug("splitting graph: %d splitting node(s) found", len(splitting_ids))

    split_gm = split_module(gm, None, lambda node: piece_of[node], keep_original_order=True)  # type: ignore[arg-type]
    items = []
    names = sorted(
        (name for name, _ in split_gm.named_children() if name.startswith("submod_")),
        key=lambda name: int(name.rsplit("_", 1)[1]),
    )
    for index, name in enumerate(names):
        piece_id = int(name.rsplit("_", 1)[1])
        module = getattr(split_gm, name)
        assert isinstance(module, torch.fx.GraphModule), f"{name} is not a GraphModule"
        items.append(SplitItem(name, index, piece_id in splitting_ids, module))
    return split_gm, items
