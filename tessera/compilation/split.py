"""Cutting a traced graph at splitting ops (attention and friends) into ordered pieces.

Owns the matching of op specs to FX nodes and the call to ``split_module``.
"""

from __future__ import annotations

import importlib
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.fx.passes.split_module import split_module

from tessera import _compat
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


# What SDPA becomes in an Inductor graph (aten overloads per backend), for Inductor's own partitioning.
_SDPA_ATEN = (
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
)


def partition_op_names(specs: Sequence[SplittingOp]) -> tuple[str, ...]:
    """The splitting ops as Inductor's ``custom_should_partition_ops`` names (``ns::op[.overload]``).

    Python callables other than SDPA have no op name Inductor could partition on: they are left out.
    """
    names: list[str] = []
    for spec in specs:
        if isinstance(spec, str) and "::" in spec:
            names.append(spec)
        elif isinstance(spec, _compat.OpOverloadPacket):
            names.append(packet_name(spec))
        elif isinstance(spec, _compat.OpOverload):
            names.append(op_overload_name(spec))
        elif spec is torch.nn.functional.scaled_dot_product_attention or spec == (
            "torch.nn.functional.scaled_dot_product_attention"
        ):
            names.extend(_SDPA_ATEN)
        else:
            log.info("splitting op %r has no op name for Inductor's graph partition; not partitioned", spec)
    return tuple(dict.fromkeys(names))


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


class SplitMatcher:
    """Tells whether a node calls one of the splitting-op specs, and which specs never matched.

    ``"ns::op"`` matches every overload of the op, ``"ns::op.overload"`` only that one (a call to
    the packet counts as ``.default``); other specs match by identity of the call target.
    """

    def __init__(self, specs: Sequence[SplittingOp]) -> None:
        self.specs = tuple(specs)
        self.matched: set[int] = set()
        self._packets: dict[str, int] = {}
        self._overloads: dict[str, int] = {}
        self._targets: list[tuple[object, int]] = []
        for i, spec in enumerate(self.specs):
            if isinstance(spec, str) and "::" in spec:
                (self._overloads if "." in spec.split("::", 1)[1] else self._packets)[spec] = i
            elif isinstance(spec, str):
                self._targets.append((_resolve_dotted(spec), i))
            elif isinstance(spec, _compat.OpOverloadPacket):
                self._packets[packet_name(spec)] = i
            elif isinstance(spec, _compat.OpOverload):
                self._overloads[op_overload_name(spec)] = i
            elif callable(spec):
                self._targets.append((spec, i))
            else:
                raise ConfigError(f"splitting op {spec!r} is not an op name ('ns::op'), an op or a callable")

    def __call__(self, node: torch.fx.Node) -> bool:
        found = self._spec_of(node)
        if found is not None:
            self.matched.add(found)
        return found is not None

    def _spec_of(self, node: torch.fx.Node) -> int | None:
        if node.op != "call_function":
            return None
        target = node.target
        if isinstance(target, _compat.OpOverloadPacket):
            name = packet_name(target)
            return self._packets.get(name, self._overloads.get(f"{name}.default"))
        if isinstance(target, _compat.OpOverload):
            found = self._packets.get(op_schema_name(target))
            return found if found is not None else self._overloads.get(op_overload_name(target))
        return next((i for t, i in self._targets if target is t), None)

    def unmatched(self) -> list[str]:
        """Names of the specs no node of the graph called."""
        from tessera.config import op_name

        return [op_name(spec) for i, spec in enumerate(self.specs) if i not in self.matched]


def split_graph(
    gm: torch.fx.GraphModule, specs: Sequence[SplittingOp] | SplitMatcher
) -> tuple[torch.fx.GraphModule, list[SplitItem]]:
    """Cut ``gm`` before and after every splitting-op node; return the split module and pieces.

    A ``getitem`` on a node's result stays in that node's piece so that no piece takes a whole
    tuple as input (``_keep_with_source``). Splitting ops with nothing compiled between them share
    one splitting piece (no empty piece between them). Original node order is kept: reordering
    breaks graphs with in-place mutation.
    """
    matches = specs if isinstance(specs, SplitMatcher) else SplitMatcher(specs)
    piece_of: dict[torch.fx.Node, int] = {}
    last_of: dict[int, torch.fx.Node] = {}  # piece -> its last node so far
    splitting_ids: set[int] = set()
    current = 0
    after_split = False  # the last node placed (getitems aside) was a splitting op
    moved = False
    for node in list(gm.graph.nodes):
        if node.op in ("placeholder", "output"):
            continue
        source = _keep_with_source(node, piece_of)
        if source is not None:
            piece = piece_of[node] = piece_of[source]
            if piece != current:
                last_of[piece].append(node)
                moved = True
            last_of[piece] = node
            continue
        if matches(node):
            if not after_split:
                current += 1
                splitting_ids.add(current)
            after_split = True
        elif after_split:
            current += 1
            after_split = False
        piece_of[node] = current
        last_of[current] = node
    log.debug("splitting graph: %d splitting node(s) found", len(splitting_ids))
    if moved:
        gm.recompile()

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


def _keep_with_source(node: torch.fx.Node, piece_of: dict[torch.fx.Node, int]) -> torch.fx.Node | None:
    """The node whose piece a ``getitem`` goes in (its source's), or None: not a getitem, a getitem
    on an input, or one whose index reads a node of a later piece (then it is an ordinary node).

    A getitem that comes after a cut moves to the end of its source's piece, where that piece
    computes it, so the pieces follow the graph's order: ``split_module`` requires it of a graph
    that enters autocast or sets grad mode ("monotonically increasing partitions"), and
    transformers 4.x disables autocast in its rotary embedding and slices the causal mask, made
    before the first attention, in every layer.
    """
    source = node.args[0] if node.args else None
    if not (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(source, torch.fx.Node)
        and source in piece_of
    ):
        return None
    piece = piece_of[source]
    later = [n for n in node.all_input_nodes if n is not source and piece_of.get(n, -1) > piece]
    return None if later else source


def dump_split_graph(split_gm: torch.fx.GraphModule, items: Sequence[SplitItem]) -> str:
    """A readable Python file: the split module, then every piece's code."""
    # graph_source, not .code: that compiles a lazy graph module's forward, holding the GIL.
    header = "# tessera computation graph: the split module, then each piece.\n"
    parts = [header, _compat.graph_source(split_gm)]
    for item in items:
        kind = "splitting (runs as is)" if item.is_splitting else "compiled"
        code = _compat.graph_source(item.graph)
        parts.append(f"\n# ---- {item.name} (piece {item.index}, {kind}) ----\n{code}")
    return "".join(parts)


class PieceCall(NamedTuple):
    """One compiled piece as the split module calls it: its inputs' fake values (Dynamo's
    example values) and their real values where the traced call had them."""

    item: SplitItem
    fake_args: list[Any]
    real_args: list[Any | None]


def piece_calls(
    split_gm: torch.fx.GraphModule, items: Sequence[SplitItem], real_inputs: list[Any]
) -> list[PieceCall]:
    """Per compiled piece: its inputs' fake values (Dynamo's example values) and real values where known.

    No fake execution: split_module copies each input's example value onto the piece's
    placeholders, which is all a runner needs.
    """
    by_name = {item.name: item for item in items}
    placeholders = [n for n in split_gm.graph.nodes if n.op == "placeholder"]
    real_of = dict(zip(placeholders, real_inputs, strict=True))
    calls = []
    for node in split_gm.graph.nodes:
        item = by_name.get(node.target) if node.op == "call_module" else None  # type: ignore[arg-type]
        if item is None or item.is_splitting:
            continue
        inputs = [n for n in item.graph.graph.nodes if n.op == "placeholder"]
        fake = [n.meta.get("example_value") for n in inputs]
        missing = [n.name for n, v in zip(inputs, fake, strict=True) if v is None]
        assert not missing and len(fake) == len(node.args), (
            f"{item.name}: Dynamo left no example value for inputs {missing}"
        )
        real = [real_of.get(a) if isinstance(a, torch.fx.Node) else None for a in node.args]
        calls.append(PieceCall(item, fake, real))
    return calls
