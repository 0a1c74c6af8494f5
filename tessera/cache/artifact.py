"""The whole-model artifact: what rebuilds a compiled model in a new process without Dynamo.

It holds Dynamo's bytecode in portable form, the split module and each piece's dispatch record;
the piece artifacts stay content-addressed in the entry. A pointer file per model fingerprint
(``<root>/warm/<fingerprint>.json``) finds the entry before anything is traced.

Why our own portable bytecode and not torch's AOT serialization (``aot_compile_fullgraph`` with a
``SerializableCallable`` backend, ``torch.compiler.load_compiled_function``; read on torch 2.11
and 2.13): loading through it imports ``torch._dynamo`` and patches ``torch._inductor.config``
(1.08 s in a fresh process after ``import torch`` on the 2-core benchmark machine, against
~45 ms for our whole warm start of the toy Llama, ``import tessera`` to first output), and it
rebuilds a guard manager from the saved guard state, which tessera drops by design. It also
holds one full-graph frame, where a model's artifact here holds every frame the model runs
(prefill, ``StaticCache`` decode, sliding-window variants) and shares identical pieces between
them by content.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import hashlib
import importlib.util
import io
import logging
import marshal
import pickle
import platform
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera import _compat
from tessera._compat import op_schema_name, overload_of, packet_name
from tessera.cache.entry import MODEL, sha256_file
from tessera.cache.key import SourceFile
from tessera.cache.refusal import Refused
from tessera.call_check import CallSpec
from tessera.layout import OutputLayout
from tessera.piece import PieceRecord
from tessera.portable import PortableCode, resolve_globals

# 11: a piece record holds its inputs as traced (piece_inputs) and, with auto sizes, the graphs
# are kept for any compiler; 10: an assumption says its kind, path and dim (assumption.Kind);
# 9: one artifact holds every trace of one graph (variants); 8: PortableCode binds every global
# Dynamo installed (7 lost the alias of a script's __main__) and records the names the code reads
# from each module; 7: the pickled CallSpec moved
FORMAT = 11

log = logging.getLogger(__name__)


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
            return _load_code, (_CODE_TAG, marshal.dumps(obj))
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
    if tag != _CODE_TAG:
        raise ValueError(f"code saved by another Python ({tag}, this one is {_CODE_TAG})")
    code = marshal.loads(data)
    if not isinstance(code, types.CodeType):
        raise ValueError("not a code object")
    return code


def _resolve_op(qualified: str, overload: str | None) -> Any:
    namespace, name = qualified.split("::", 1)
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _dumps(value: Any) -> bytes:
    stream = io.BytesIO()
    _Pickler(stream, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return stream.getvalue()


_FILENAME = "<tessera split module>"
_CODE_TAG = f"{sys.implementation.cache_tag}:{importlib.util.MAGIC_NUMBER.hex()}"


@dataclass(frozen=True)
class PortableModule:
    """An FX module's forward as its generated source and the globals and attributes it reads.

    Rebuilt by one ``exec``: unpickling a GraphModule re-traces its code (~10 ms a module, which
    a 32-layer model pays 65 times, and which fails on graphs with asserts on sizes).
    """

    source: str
    modules: tuple[tuple[str, str], ...]  # (global name, module name)
    values: bytes  # pickle of the other globals and of the attributes the code reads from self
    # The source compiled, as marshal data for this interpreter (tagged): a 65-piece split
    # module's compile costs milliseconds a start, its unmarshal microseconds.
    code: tuple[str, bytes] | None = None

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, positional: bool = False) -> PortableModule:
        """``positional``: name values by position (the module is only called positionally), so
        that identical layers, which differ only in their inputs' names, share one source."""
        code = (_renamed_by_position(gm.graph) if positional else gm.graph).python_code(root_module="self")
        modules = {n: v.__name__ for n, v in code.globals.items() if isinstance(v, types.ModuleType)}
        others = {n: v for n, v in code.globals.items() if n not in modules}
        attrs = {str(n.target): _attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
        compiled = marshal.dumps(compile(code.src, _FILENAME, "exec"))
        return cls(code.src, tuple(sorted(modules.items())), _dumps((others, attrs)), (_CODE_TAG, compiled))

    def build(self, attributes: dict[str, Any]) -> Callable[..., Any]:
        """The forward, bound to an object holding ``attributes`` and the saved ones."""
        others, attrs = pickle.loads(self.values)
        namespace = {**others, **{n: importlib.import_module(m) for n, m in self.modules}}
        if self.code is not None and self.code[0] == _CODE_TAG:
            code = marshal.loads(self.code[1])
        else:  # another interpreter wrote it: its marshal format may differ, compile the source
            code = compile(self.source, _FILENAME, "exec")
        exec(code, namespace)
        holder = types.SimpleNamespace(**attrs, **attributes)
        return types.MethodType(namespace["forward"], holder)


def _renamed_by_position(graph: torch.fx.Graph) -> torch.fx.Graph:
    """A copy of ``graph`` whose values are named ``v<i>`` in node order (inputs included)."""
    renamed = copy.deepcopy(graph)
    for i, node in enumerate(renamed.nodes):
        if node.op == "output":
            continue
        node.name = f"v{i}"
        if node.op == "placeholder":
            node.target = node.name  # the parameter name in the generated signature
    return renamed


@dataclass(frozen=True)
class _Ref:
    name: str


def dump_graph(gm: torch.fx.GraphModule) -> bytes:
    """A GraphModule as its nodes (no metadata): rebuilt by ``load_graph`` without re-tracing."""
    return _dumps(_graph_state(gm))


def _graph_state(gm: torch.fx.GraphModule) -> tuple[list[Any], dict[str, Any]]:
    nodes = []
    attrs: dict[str, Any] = {}
    for n in gm.graph.nodes:
        args = torch.fx.node.map_arg(n.args, lambda a: _Ref(a.name))  # type: ignore[arg-type,return-value]
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: _Ref(a.name))  # type: ignore[arg-type,return-value]
        nodes.append((n.op, n.name, n.target, args, kwargs, n.type))
        if n.op == "get_attr":
            value = _attr(gm, str(n.target))
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


def _attr(gm: torch.fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


MAX_VARIANTS = 32  # traces one entry's whole-model artifact keeps (the newest)


@dataclass(frozen=True)
class Variant:
    """One trace of the entry's graph: Dynamo's bytecode and what the trace assumed of a call.
    Traces of one model whose graphs are the same (a branch whose sides do the same thing, a
    kernel's bound on a size) share the pieces and differ only here."""

    key: str  # digest of the two, named by the model's pointer
    code: PortableCode  # Dynamo's bytecode: calls the split module with the graph inputs
    call_spec: CallSpec

    @classmethod
    def of(cls, code: PortableCode, call_spec: CallSpec) -> Variant:
        return cls(hashlib.sha256(_dumps((code, call_spec))).hexdigest()[:20], code, call_spec)


class ArtifactState(enum.Enum):
    """Where a trace's whole-model artifact stands."""

    OFF = "not written (cache disabled)"
    PENDING = "to be written once every size is compiled"
    WRITTEN = "written"
    LOADED = "loaded"
    NOT_WRITTEN = "not written"


@dataclass(frozen=True)
class ArtifactFate:
    """A trace's whole-model artifact: where it stands, and why it was not written."""

    state: ArtifactState
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.state.value}: {self.reason}" if self.reason else self.state.value


@dataclass(frozen=True)
class ModelArtifact:
    """Everything but the piece artifacts, which stay content-addressed in the entry."""

    format: int
    python: str
    variants: tuple[Variant, ...]  # every trace of this graph saved so far
    split_module: PortableModule  # calls the pieces in order
    modules: tuple[tuple[str, PortableModule], ...]  # splitting piece -> its module
    graphs: tuple[tuple[str, bytes], ...]  # content -> dump_graph of a piece (for compilers that need it)
    piece_graphs: tuple[tuple[str, str], ...]  # compiled piece -> content of its graph
    pieces: tuple[PieceRecord, ...]  # the compiled pieces' records
    layouts: tuple[tuple[str, OutputLayout | None], ...]  # splitting piece -> output strides
    sources: tuple[SourceFile, ...]

    def with_variants_of(self, other: ModelArtifact | None) -> ModelArtifact:
        """This artifact, keeping ``other``'s traces too when it is of the same split graph."""
        if other is None or other.split_module != self.split_module or other.pieces != self.pieces:
            return self
        keys = {v.key for v in self.variants}
        kept = tuple(v for v in other.variants if v.key not in keys)
        # Models with one graph share the entry: each trace a variant, the newest kept.
        return dataclasses.replace(self, variants=(kept + self.variants)[-MAX_VARIANTS:])


def make(
    code: PortableCode,
    split_gm: torch.fx.GraphModule,
    pieces: Sequence[PieceRecord],
    splitting: Sequence[str],
    layouts: Sequence[tuple[str, OutputLayout | None]],
    sources: Sequence[SourceFile],
    contents: dict[str, str],
    call_spec: CallSpec,
    laid_out: bool = False,
) -> ModelArtifact:
    """The artifact of a finished trace. ``contents`` (piece -> content hash) keeps those compiled
    pieces' graphs, once per distinct content: for compilers that load from a graph, that compile
    the sizes a warm process learns, or whose artifact assumed more of the sizes than the trace
    checks (a call outside that runs as traced). ``laid_out``: as Inductor is given a graph, its
    outputs in eager's layout (layout.keep_eager_layouts)."""
    # _modules, not getattr: the backend shadows each submodule with what runs it.
    children: dict[str, Any] = dict(split_gm.named_children())
    modules = {name: PortableModule.of(children[name], positional=True) for name in splitting}
    graphs: dict[str, bytes] = {}
    piece_graphs = []
    for record in pieces:
        content = contents.get(record.name)
        if content is None:
            continue
        if content not in graphs:
            child = children[record.name]
            if not laid_out:
                graphs[content] = dump_graph(child)
            else:  # kept only for a warm process's learning: one that does not pickle is left out
                from tessera.layout import keep_eager_layouts

                try:
                    graphs[content] = dump_graph(keep_eager_layouts(child))
                except Exception as e:
                    log.debug("%s: graph not kept for learning (%s: %s)", record.name, type(e).__name__, e)
                    continue
        piece_graphs.append((record.name, content))
    return ModelArtifact(
        format=FORMAT,
        python=platform.python_version(),
        variants=(Variant.of(code, call_spec),),
        split_module=PortableModule.of(split_gm),
        modules=tuple(modules.items()),
        graphs=tuple(graphs.items()),
        piece_graphs=tuple(piece_graphs),
        pieces=tuple(dataclasses.replace(p, served=()) for p in pieces),
        layouts=tuple(layouts),
        sources=tuple(sources),
    )


def dumps(artifact: ModelArtifact) -> bytes:
    return _dumps(artifact)


def loads(data: bytes) -> ModelArtifact | Refused:
    """Unpickle an artifact (its checksum was verified by the caller) and check it fits here; or
    why it does not."""
    try:
        artifact = pickle.loads(data)
    except Exception as e:
        return Refused(f"{MODEL} does not load ({type(e).__name__}: {e})")
    if not isinstance(artifact, ModelArtifact) or artifact.format != FORMAT:
        return Refused(f"{MODEL} has another format")
    if artifact.python != platform.python_version():
        return Refused(f"the artifact's bytecode is for Python {artifact.python}")
    for source in artifact.sources:
        try:
            if sha256_file(Path(source.path)) != source.sha256:
                return Refused(f"{source.path} changed since the artifact was made")
        except OSError:
            return Refused(f"{source.path} is not readable")
    return artifact


def check_binds(variant: Variant) -> Refused | None:
    """Why the variant's bytecode does not bind its globals in this process (None: it does).
    Bound again by the rebuild; checked before any kernel loads."""
    bound = resolve_globals(variant.code)
    if isinstance(bound, Refused):  # a name of the user's script this process does not define
        return Refused(f"Dynamo's bytecode does not bind here: {bound}")
    return None
