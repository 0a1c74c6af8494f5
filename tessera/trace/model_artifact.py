"""The whole-model artifact: what rebuilds a compiled model in a new process without Dynamo.

It holds Dynamo's bytecode in portable form, the split module and each piece's dispatch record;
the piece artifacts stay content-addressed in the entry. A pointer file per model fingerprint
(``<root>/warm/<fingerprint>.json``) finds the entry before anything is traced.

Why our own portable bytecode and not torch's AOT serialization (``aot_compile_fullgraph`` with a
``SerializableCallable`` backend, ``torch.compiler.load_compiled_function``; read on torch 2.11
and 2.13): loading through it imports ``torch._dynamo`` and patches ``torch._inductor.config``
(about a second in a fresh process after ``import torch``, some twenty times tessera's whole warm
start of the toy Llama; ``benchmarks/startup.py``), and it
rebuilds a guard manager from the saved guard state, which tessera drops by design. It also
holds one full-graph frame, where a model's artifact here holds every frame the model runs
(prefill, ``StaticCache`` decode, sliding-window variants) and shares identical pieces between
them by content.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import logging
import marshal
import pickle
import platform
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera.cache.entry import MODEL, sha256_file
from tessera.cache.key import SourceFile
from tessera.cache.refusal import Refused
from tessera.compilation.graph_pickle import CODE_TAG, attribute, dump_graph, dumps as _dumps
from tessera.compilation.layout import OutputLayout
from tessera.compilation.piece import PieceRecord
from tessera.trace.call_check import CallSpec
from tessera.trace.portable import PortableCode, resolve_globals

# 12: the pickled records' modules moved into stage folders (tessera.trace, .compilation, ...);
# 11: a piece record holds its inputs as traced (piece_inputs) and, with auto sizes, the graphs
# are kept for any compiler; 10: an assumption says its kind, path and dim (assumption.Kind);
# 9: one artifact holds every trace of one graph (variants); 8: PortableCode binds every global
# Dynamo installed (7 lost the alias of a script's __main__) and records the names the code reads
# from each module; 7: the pickled CallSpec moved
FORMAT = 12

log = logging.getLogger(__name__)


_FILENAME = "<tessera split module>"


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
        attrs = {str(n.target): attribute(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr"}
        compiled = marshal.dumps(compile(code.src, _FILENAME, "exec"))
        return cls(code.src, tuple(sorted(modules.items())), _dumps((others, attrs)), (CODE_TAG, compiled))

    def build(self, attributes: dict[str, Any]) -> Callable[..., Any]:
        """The forward, bound to an object holding ``attributes`` and the saved ones."""
        others, attrs = pickle.loads(self.values)
        namespace = {**others, **{n: importlib.import_module(m) for n, m in self.modules}}
        if self.code is not None and self.code[0] == CODE_TAG:
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
                from tessera.compilation.layout import keep_eager_layouts

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
