"""What makes two compiles interchangeable: one ``KeyRecord`` per kind of key (entry, fingerprint,
artifact, compiler, config, machine), each built by the one hasher from factors it can print.

Nothing that varies run to run (paths, pids, times) enters a key. Nothing here imports Dynamo or
Inductor: a warm start computes the fingerprint before deciding whether it needs either.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera import _compat
from tessera.config import CompileConfig

log = logging.getLogger(__name__)

# TESSERA_* variables that change compiled code (the others: paths and switches, do not).
CODE_ENV_VARS = (
    "TESSERA_MODE",
    "TESSERA_DYNAMIC_SHAPES",
    "TESSERA_BACKEND",
    "TESSERA_COMPILE_SIZES",
    "TESSERA_COMPILE_RANGES",
    "TESSERA_MAX_SIZE",
    "TESSERA_CUDAGRAPH_MODE",
    "TESSERA_CUDAGRAPH_CAPTURE_SIZES",
)
# 10: the whole-model artifact moved to format 12 (its records' modules moved into stage folders);
# 9: the calls left out (one pointer lists every trace of a model); 8 and 7: the whole-model
# artifact moved to formats 8 and 7 (old pointers are a clean miss, not a
# fallback); 6: values of objects the model holds, the attention implementation; 5: the full call
# state
FINGERPRINT_FORMAT = 10
# 4: the symbols' ranges and guards (a piece compiled under other ranges is other code)
PIECE_CONTENT_FORMAT = 4
_TORCH_DIR = str(Path(torch.__file__).parent)
_SYMBOL = re.compile(r"\b[su]\d+\b")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(value: Any) -> str:
    """The one hasher of key factors: sha256 of their canonical JSON (sorted keys)."""
    return sha256_bytes(json.dumps(value, sort_keys=True, default=str).encode())


KEY_KINDS = ("entry", "fingerprint", "artifact", "compiler", "config", "machine")


@dataclass(frozen=True)
class KeyRecord:
    """One key and the factors it is the hash of (JSON-ready; treat as read-only).

    ``entry``: a cache entry's directory (cache_key_factors.json holds its factors); ``fingerprint``:
    a model and call, found before tracing; ``artifact``: one compiled piece at one size;
    ``compiler`` and ``config``: the parts of those keys a compiler and a config contribute;
    ``machine``: what compiled CPU code depends on. Built only by ``of``, so every key is made by
    the same recipe, and printed by ``debug_lines`` (``tessera cache explain``).
    """

    kind: str
    factors: Mapping[str, Any]
    digest: str

    @classmethod
    def of(cls, kind: str, factors: Mapping[str, Any]) -> KeyRecord:
        assert kind in KEY_KINDS, f"unknown key kind {kind!r}; known: {KEY_KINDS}"
        return cls(kind, factors, sha256_json(factors))

    def debug_lines(self, width: int = 120) -> list[str]:
        """``<kind> key <digest>``, then one ``  name: value`` line per factor (values cut to width)."""
        lines = [f"{self.kind} key {self.digest}"]
        for name, value in sorted(self.factors.items()):
            text = json.dumps(value, sort_keys=True, default=str)
            lines.append(f"  {name}: {text if len(text) <= width else text[: width - 3] + '...'}")
        return lines


@dataclass(frozen=True)
class SourceFile:
    """A source file Dynamo traced: where it is now, and the sha256 of its content."""

    path: str
    sha256: str


def traced_sources(codes: Iterable[types.CodeType]) -> list[SourceFile]:
    """The files behind the traced code objects, torch's own excepted (the torch version covers them)."""
    out = {}
    for code in codes:
        name = code.co_filename
        if name in out or name.startswith(_TORCH_DIR) or not os.path.isfile(name):
            continue
        out[name] = SourceFile(name, sha256_bytes(Path(name).read_bytes()))
    return sorted(out.values(), key=lambda s: s.path)


# -- the machine --------------------------------------------------------------------------------
@functools.cache
def machine_factors() -> dict[str, str]:
    """What compiled CPU code depends on beyond torch: the CPU's flags and the C++ compiler.

    Kernels built for one machine's vector ISA must not be loaded on another; the compiler is
    identified by its path, size and modification time (no subprocess on a warm start).
    """
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features", "features")):
                    flags = " ".join(sorted(set(line.split(":", 1)[1].split())))
                    break
    except OSError:
        flags = platform.processor()
    compiler = os.environ.get("CXX") or "g++"
    found = shutil.which(compiler)
    identity = compiler
    if found is not None:
        stat = os.stat(found)
        identity = f"{os.path.realpath(found)}:{stat.st_size}:{int(stat.st_mtime)}"
    return {
        "machine": platform.machine(),
        "cpu_flags": sha256_bytes(flags.encode())[:16],
        "cxx": identity,
    }


def machine_key() -> str:
    return KeyRecord.of("machine", machine_factors()).digest[:16]


# -- entry key ----------------------------------------------------------------------------------
def graph_signature(gm: torch.fx.GraphModule) -> str:
    """sha256 of the traced graph's code and its inputs' shapes, dtypes and devices."""
    parts = [_compat.graph_source(gm)]  # not gm.code: that compiles the whole graph, holding the GIL
    values = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("example_value")
            values.append(value)
            if isinstance(value, torch.Tensor):
                parts.append(f"{node.name}:{tuple(map(str, value.shape))}:{value.dtype}:{value.device}")
            else:
                parts.append(f"{node.name}:{type(value).__name__}")
    # The same code traced under other symbol ranges or guards compiles to other code.
    parts.extend(_compat.symbol_knowledge(values))
    return sha256_bytes("\n".join(parts).encode())


def collect_factors(
    config: CompileConfig,
    compiler_name: str,
    compiler_hash: str,
    sources: Sequence[SourceFile],
    graph_hash: str,
) -> dict[str, Any]:
    """The raw factors, JSON-ready. Source files enter by content, under their base name only."""
    return {
        "env": {name: os.environ[name] for name in CODE_ENV_VARS if name in os.environ},
        "config": config.hash_factors(),
        "compiler": {"name": compiler_name, "hash": compiler_hash},
        "torch_version": torch.__version__,
        "graph": graph_hash,
        # The eager compiler's graph is the same under autocast: the entry (and its whole-model
        # artifact) must not be shared between states the graph would run differently under.
        "call_state": repr(_compat.call_state()),
        "sources": {Path(s.path).name + "@" + s.sha256[:12]: s.sha256 for s in sources},
        # How piece_content describes a piece: an entry made by another recipe may hold a shape's
        # artifact shared between pieces the current one tells apart (2: the "order:" line; 3: a
        # shape's values in the order Dynamo made the symbols, not by name; 4: the symbols'
        # ranges and guards).
        "piece_content": PIECE_CONTENT_FORMAT,
    }


def config_record(config: CompileConfig) -> KeyRecord:
    """A compile config's ``hash_factors()`` as a key record: equal configs, equal digests, in
    every process."""
    return KeyRecord.of("config", config.hash_factors())


def entry_key(factors: Mapping[str, Any]) -> KeyRecord:
    """The key of the entry ``collect_factors`` described (its directory is ``digest[:10]``)."""
    return KeyRecord.of("entry", factors)


# -- piece content ------------------------------------------------------------------------------
def piece_content(graph: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    """sha256 of a piece as a compiler sees it: its nodes with positional names, and its inputs'
    shapes, strides, dtypes and devices. Two transformer layers give the same value, so each
    distinct piece is compiled once."""
    symbols: dict[str, str] = {}

    def canon(text: str) -> str:
        return _SYMBOL.sub(lambda m: symbols.setdefault(m.group(0), f"S{len(symbols)}"), text)

    def describe_input(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return canon(
                f"T{tuple(map(str, value.shape))}{tuple(map(str, value.stride()))}"
                f"{value.dtype}{value.device}{value.requires_grad}"
            )
        if isinstance(value, torch.SymInt):
            return canon(f"I{value}")
        return f"{type(value).__name__}:{value!r}"

    lines = [describe_input(v) for v in example_inputs]
    if len(symbols) > 1:
        # A shape's values are given in piece.size_symbols order (as Dynamo made the symbols), the
        # content in the order they first appear: two pieces alike but for which size is which
        # dim must not share a shape's artifact.
        ranks = _compat.symbol_ranks(example_inputs)
        order = sorted(symbols, key=lambda name: (ranks.get(name, len(ranks)), name))
        lines.append("order:" + ",".join(symbols[name] for name in order))
    lines.extend(_canonical_nodes(graph, canon))
    # What the trace knew of the symbols (ranges, guards): Inductor simplifies with it.
    lines.extend(canon(fact) for fact in _compat.symbol_knowledge(example_inputs))
    return sha256_bytes("\n".join(lines).encode())


def _canonical_nodes(graph: torch.fx.GraphModule, canon: Any) -> list[str]:
    names: dict[torch.fx.Node, str] = {}
    lines = []

    def arg(value: Any) -> Any:
        return torch.fx.node.map_arg(value, lambda n: names[n])  # type: ignore[arg-type]

    for i, node in enumerate(graph.graph.nodes):
        names[node] = f"v{i}"
        if node.op == "get_attr":
            target = _attr_content(graph, str(node.target), canon)
        elif node.op == "call_function":
            target = _callable_name(node.target)
        else:
            target = str(node.target) if node.op != "placeholder" else ""
        lines.append(canon(f"{names[node]}={node.op}:{target}({arg(node.args)!r},{arg(node.kwargs)!r})"))
    return lines


def _callable_name(target: Any) -> str:
    if isinstance(target, (_compat.OpOverload, _compat.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}"


def _attr_content(graph: torch.fx.GraphModule, target: str, canon: Any) -> str:
    value: Any = graph
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, torch.fx.GraphModule):
        return "graph:" + ";".join(_canonical_nodes(value, canon))
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous()
        digest = sha256_bytes(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        return f"tensor:{tuple(value.shape)}:{value.dtype}:{value.device}:{digest}"
    return f"attr:{type(value).__qualname__}:{value!r}"


# -- model fingerprint (found before any trace) ---------------------------------------------------
def code_digest(code: types.CodeType) -> str:
    """sha256 of what a code object does: its bytecode, names and constants.

    Not ``marshal.dumps(code)``: marshal's output depends on reference counts, which differ
    between a process that traced the code and one that did not.
    """
    parts: list[Any] = [
        code.co_code,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        code.co_argcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_name,
    ]
    for const in code.co_consts:
        parts.append(code_digest(const) if isinstance(const, types.CodeType) else _const_repr(const))
    return sha256_bytes(repr(parts).encode())


def _const_repr(value: Any) -> str:
    if isinstance(value, (frozenset, set)):  # iteration order follows the string hash seed
        return f"frozenset({sorted(_const_repr(v) for v in value)})"
    if isinstance(value, tuple):
        return f"({', '.join(_const_repr(v) for v in value)},)"
    return repr(value)


def describe(value: Any, dynamic: frozenset[int] = frozenset(), depth: int = 0, held: bool = False) -> Any:
    """A stable, JSON-ready description of a value as a trace depends on it.

    Tensors by dtype, device, rank, static sizes (dims in ``dynamic`` as ``*``) and contiguity;
    scalars by value; containers and plain objects (a ``StaticCache``) by their contents, to a
    bounded depth. Anything else by its type. ``held``: an object the model holds (its config),
    whose ints and floats count by value; an argument's count by type (a cache's moving length).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        shape = ["*" if d in dynamic else s for d, s in enumerate(value.shape)]
        return [
            "tensor",
            str(value.dtype),
            str(value.device),
            shape,
            value.is_contiguous(),
            value.requires_grad,
        ]
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    if depth >= 4:
        return type(value).__qualname__
    if isinstance(value, (tuple, list)):
        return [
            type(value).__name__,
            [describe(v, depth=depth + 1, held=held) for v in value[:64]],
            len(value),
        ]
    if isinstance(value, dict):
        items = list(value.items())[:64]
        return ["dict", sorted((_const_repr(k), describe(v, depth=depth + 1, held=held)) for k, v in items)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: describe(getattr(value, f.name, None), depth=depth + 1, held=held)
            for f in dataclasses.fields(value)
        }
        return [type(value).__qualname__, sorted(fields.items()), _attention(value)]
    to_dict = getattr(value, "to_dict", None)  # Hugging Face configs
    if callable(to_dict) and not isinstance(value, torch.nn.Module):
        try:
            described = json.dumps(to_dict(), sort_keys=True, default=str)
            return [type(value).__qualname__, described, _attention(value)]
        except (TypeError, ValueError):
            pass
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(value, (torch.nn.Module, types.ModuleType, type)):
        items = sorted(attrs.items(), key=lambda kv: str(kv[0]))[:64]
        # An object's ints (a cache's current length) by type only: the call check (call_check.py)
        # knows which of them the trace assumed, and a moving length must not hide the artifact.
        return [type(value).__qualname__, [(str(k), _attribute(v, depth, held)) for k, v in items]]
    return type(value).__qualname__


def _attention(config: Any) -> str:
    # transformers keeps the attention implementation outside the config's fields and to_dict(),
    # yet it picks the attention code the trace inlines (eager vs SDPA).
    try:
        return str(getattr(config, "_attn_implementation", None))
    except Exception:  # a config property that raises: the fields still decide
        return "unknown"


def _attribute(value: Any, depth: int, held: bool) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not held:
        return type(value).__name__
    if isinstance(value, torch.Tensor) and not held:
        # A tensor an argument object holds (a KV cache's keys) by kind only: its sizes move from
        # call to call, and the artifact's call check compares them before a warm start uses it.
        return ["tensor", str(value.dtype), str(value.device), value.dim()]
    return describe(value, depth=depth + 1, held=held)


def _module_state(model: torch.nn.Module) -> list[Any]:
    state: list[Any] = []
    for name, module in model.named_modules():
        attrs = {
            k: describe(v, depth=2, held=True)
            for k, v in vars(module).items()
            # An instance ``forward`` is a wrapper standing in for the class's (tessera.hf's):
            # code, and what it holds is not what the trace reads.
            if not k.startswith("_") and k != "forward" and not isinstance(v, torch.nn.Module)
        }
        state.append((name, type(module).__qualname__, module.training, sorted(attrs.items())))
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for pname, tensor in tensors:
            if tensor is not None:
                state.append((f"{name}.{pname}", tuple(tensor.shape), str(tensor.dtype), str(tensor.device)))
    return state


def fingerprint_record(
    func: types.FunctionType,
    bound_to: object | None,
    dynamic_dims: Mapping[str, Any] | None,
    config: CompileConfig,
    compiler_hash: str,
    prefix: str,
    rank: str,
) -> KeyRecord:
    """All that decides a model's traces and is known before any call; its ``digest`` names the
    warm pointer that lists them. The calls are not in it: each trace's check (call_check.py)
    says which calls it serves, so every kind of call a model saw is found from one pointer."""
    code = func.__code__
    factors = {
        "format": FINGERPRINT_FORMAT,
        "python": platform.python_version(),
        "torch": [torch.__version__, getattr(torch.version, "git_version", None)],
        # The file's whole path: two scripts of one name in two directories (a/serve.py and
        # b/serve.py, each __main__) are two models. The artifact records its sources by path
        # anyway, so a cache is shared only where the code lies at the same path.
        "function": [func.__module__, func.__qualname__, os.path.abspath(code.co_filename)],
        "code": code_digest(code),
        "closure": [describe(c.cell_contents, depth=2) for c in (func.__closure__ or ())],
        "defaults": describe(func.__defaults__),
        "model": _module_state(bound_to) if isinstance(bound_to, torch.nn.Module) else repr(type(bound_to)),
        "dynamic_dims": repr(sorted((dynamic_dims or {}).items())),
        # The global state the graph bakes in (autocast on any device, default dtype, function
        # modes). Grad mode is not: tessera traces inference graphs whatever the caller's mode.
        "state": repr(_compat.call_state()),
        "config": config_record(config).digest,
        "compiler": compiler_hash,
        "where": [prefix, rank],
    }
    return KeyRecord.of("fingerprint", factors)


def graph_code_objects(gm: torch.fx.GraphModule) -> list[Any]:
    """The code objects Dynamo traced for this graph (for the cache key's source files).

    Failing the tracing context, the files named in the graph's stack traces are used.
    """
    codes = _compat.traced_code_objects()
    if codes is not None:
        return codes
    log.warning("this torch does not list traced code; the cache key covers files named in the graph")
    files = {n.meta.get("stack_trace", "") for n in gm.graph.nodes}
    names = {line.split('"')[1] for trace in files for line in trace.splitlines() if 'File "' in line}
    return [compile("", name, "exec") for name in sorted(names)]
