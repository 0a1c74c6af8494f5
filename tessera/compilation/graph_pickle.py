"""FX graphs and torch ops as bytes: a graph crosses to a compile worker, and is kept in the
whole-model artifact, as its nodes (rebuilt without a re-trace); ops, code objects and the
interpreter's own classes pickle by name."""

from __future__ import annotations

import importlib.util
import io
import marshal
import pickle
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tessera import _compat
from tessera._compat import op_schema_name, overload_of, packet_name


class _Pickler(pickle.Pickler):
    """Pickles torch ops by name: ``OpOverload`` objects themselves cannot be pickled."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _compat.OpOverload):
            return _resolve_op, (op_schema_name(obj), overload_of(obj))
        if isinstance(obj, _compat.OpOverloadPacket):
            return _resolve_op, (packet_name(obj), None)
        if isinstance(obj, types.CodeType):
            # A guard on a function's code (a wrapper's closure, Whisper's encoder): the call
            # check compares it by value, so the code travels as marshal data for this Python.
            return _load_code, (CODE_TAG, marshal.dumps(obj))
        if isinstance(obj, type) and obj in _TYPES_BY_NAME:
            # ``type(x.__code__)`` and its kind: classes pickle by their builtins name, which
            # these lack ("attribute lookup code on builtins failed").
            return _interpreter_type, (_TYPES_BY_NAME[obj],)
        return NotImplemented


# The interpreter's own classes that pickle cannot find by name, by their name in ``types``.
_TYPES_BY_NAME: dict[type, str] = {
    getattr(types, name): name
    for name in ("CodeType", "FunctionType", "MethodType", "BuiltinFunctionType", "CellType", "ModuleType")
}


def _interpreter_type(name: str) -> type:
    found = getattr(types, name)
    if found not in _TYPES_BY_NAME:
        raise ValueError(f"types.{name} is not one of the classes an artifact may name")
    return found  # type: ignore[no-any-return]


def _load_code(tag: str, data: bytes) -> types.CodeType:
    if tag != CODE_TAG:
        raise ValueError(f"code saved by another Python ({tag}, this one is {CODE_TAG})")
    code = marshal.loads(data)
    if not isinstance(code, types.CodeType):
        raise ValueError("not a code object")
    return code


def _resolve_op(qualified: str, overload: str | None) -> Any:
    namespace, name = qualified.split("::", 1)
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def dumps(value: Any) -> bytes:
    stream = io.BytesIO()
    _Pickler(stream, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return stream.getvalue()


CODE_TAG = f"{sys.implementation.cache_tag}:{importlib.util.MAGIC_NUMBER.hex()}"


@dataclass(frozen=True)
class _Ref:
    name: str


def dump_graph(gm: torch.fx.GraphModule) -> bytes:
    """A GraphModule as its nodes (no metadata): rebuilt by ``load_graph`` without re-tracing."""
    return dumps(_graph_state(gm))


def _graph_state(gm: torch.fx.GraphModule) -> tuple[list[Any], dict[str, Any]]:
    nodes = []
    attrs: dict[str, Any] = {}
    for n in gm.graph.nodes:
        args = torch.fx.node.map_arg(n.args, lambda a: _Ref(a.name))  # type: ignore[arg-type,return-value]
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: _Ref(a.name))  # type: ignore[arg-type,return-value]
        nodes.append((n.op, n.name, n.target, args, kwargs, n.type))
        if n.op == "get_attr":
            value = attribute(gm, str(n.target))
            is_graph = isinstance(value, torch.fx.GraphModule)
            attrs[str(n.target)] = ("graph", _graph_state(value)) if is_graph else ("value", value)
    return nodes, attrs


def load_graph(data: bytes) -> torch.fx.GraphModule:
    return _build_graph(*pickle.loads(data))


def _build_graph(nodes: list[Any], attrs: dict[str, Any]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    for op, name, target, saved_args, saved_kwargs, type_ in nodes:
        args, kwargs = torch.fx.node.map_aggregate(
            (saved_args, saved_kwargs), lambda a: env[a.name] if isinstance(a, _Ref) else a
        )
        env[name] = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_)
    root = torch.nn.Module()
    for target, (kind, value) in attrs.items():
        owner = root
        *path, leaf = target.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        setattr(owner, leaf, _build_graph(*value) if kind == "graph" else value)
    return torch.fx.GraphModule(root, graph)


def attribute(gm: torch.fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
