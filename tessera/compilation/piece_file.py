"""Compiled pieces as files that load at the physical limit: read the bytes, map the kernels, call.

Inductor's own loader (``CompiledArtifact.load``) imports all of Dynamo and Inductor, probes the
CPU's vector ISA and rebuilds the C++ kernels with a compiler when its cache directory is empty.
For CPU pieces tessera also keeps Inductor's *output*: the Python wrapper code it generated and
the kernel libraries it built. Loading those runs the wrapper against a small stand-in for the
few Inductor names it imports, with the kernels mapped from memory. Inductor's artifact stays in
the same file as the fallback for everything else (GPU kernels, pieces AOTAutograd wraps).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import linecache
import logging
import marshal
import os
import re
import struct
import tempfile
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera import _compat

log = logging.getLogger(__name__)

MAGIC = b"TESSERA-PIECE\x00"
# Raised with what a piece file holds; part of the compiler's key (inductor_compiler.py), so that a
# file of another format is never looked up. 2: the compile's assumptions (``guards``).
FORMAT = 2
# Names Inductor's CPU wrapper code imports from Inductor (torch 2.11-2.13); see Runtime.
RUNTIME_NAMES = {
    "run_intermediate_hooks",
    "maybe_profile",
    "_align",
    "AsyncCompile",
    "extern_kernels",
}
_LIBRARIES: dict[str, types.ModuleType] = {}  # kernel library sha256 -> loaded module
# The interpreter's bytecode version: a wrapper's code compiled by another one is compiled again.
BYTECODE = importlib.util.MAGIC_NUMBER.hex()


class NotDirect(Exception):
    """This piece cannot be loaded without Inductor (the reason); its artifact is used instead."""


@dataclass(frozen=True)
class DirectCode:
    """Inductor's output for one CPU piece, independent of Inductor's cache directory."""

    wrapper: str  # the output module, its Inductor imports rebound to ``Runtime``
    kernels: tuple[tuple[str, bytes], ...]  # (sha256 of the kernel's C++ source, library bytes)
    extern: tuple[tuple[str, str], ...]  # extern_kernels name -> torch function of that name
    num_inputs: int
    num_outputs: int
    # The wrapper compiled where the piece compiled (marshal), and the bytecode version it is in.
    # Loading it instead of compiling the wrapper: compile() holds the GIL throughout, some ms a
    # piece, a pause for every call served while a process installs a piece
    # compiled beside them or loads its pieces warm; the unmarshal takes 0.05 ms.
    code: bytes = b""
    bytecode: str = ""


@dataclass(frozen=True)
class PieceFile:
    """One compiled piece on disk: Inductor's artifact (the fallback) and the direct code."""

    standard: bytes
    direct: DirectCode | None
    returns_tuple: bool
    why_not_direct: str = ""
    partitions: int = 0  # functions Inductor's graph partition made of the piece (0: none)
    # What the compile assumed of its inputs' sizes beyond the trace's checks, as a Python
    # expression over ``L['t0']``... (_compat.compile_assumptions); "" when nothing.
    guards: str = ""

    def to_bytes(self) -> bytes:
        blobs: list[bytes] = []

        def blob(data: bytes) -> list[int]:
            offset = sum(len(b) for b in blobs)
            blobs.append(data)
            return [offset, len(data)]

        header: dict[str, Any] = {
            "format": FORMAT,
            "torch": torch.__version__,
            "standard": blob(self.standard),
            "returns_tuple": self.returns_tuple,
            "partitions": self.partitions,
            "why_not_direct": self.why_not_direct,
            "guards": self.guards,
            "direct": None,
        }
        if self.direct is not None:
            d = self.direct
            header["direct"] = {
                "wrapper": blob(d.wrapper.encode()),
                "kernels": [[sha, *blob(data)] for sha, data in d.kernels],
                "extern": [list(pair) for pair in d.extern],
                "inputs": d.num_inputs,
                "outputs": d.num_outputs,
                "code": blob(d.code),
                "bytecode": d.bytecode,
            }
        encoded = json.dumps(header, sort_keys=True).encode()
        return MAGIC + struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs)

    @classmethod
    def from_bytes(cls, data: bytes) -> PieceFile:
        """Parse a piece file; ValueError when it is not one (or not this format)."""
        if not data.startswith(MAGIC):
            raise ValueError("not a tessera piece file")
        start = len(MAGIC) + 8
        (length,) = struct.unpack("<Q", data[len(MAGIC) : start])
        header = json.loads(data[start : start + length])
        body = memoryview(data)[start + length :]
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError("another piece file format")

        def read(span: Any) -> bytes:
            offset, size = span
            if not (
                isinstance(offset, int)
                and isinstance(size, int)
                and offset >= 0
                and offset + size <= len(body)
            ):
                raise ValueError("a blob lies outside the file")
            return bytes(body[offset : offset + size])

        direct = None
        if header.get("direct") is not None:
            d = header["direct"]
            direct = DirectCode(
                wrapper=read(d["wrapper"]).decode(),
                kernels=tuple((str(sha), read((offset, size))) for sha, offset, size in d["kernels"]),
                extern=tuple((str(a), str(b)) for a, b in d["extern"]),
                num_inputs=int(d["inputs"]),
                num_outputs=int(d["outputs"]),
                code=read(d["code"]) if "code" in d else b"",  # files written before it was kept
                bytecode=str(d.get("bytecode", "")),
            )
        return cls(
            read(header["standard"]),
            direct,
            bool(header["returns_tuple"]),
            str(header.get("why_not_direct", "")),
            int(header.get("partitions", 0)),
            str(header["guards"]),
        )


# -- cold: from Inductor's compiled artifact -------------------------------------------------------
def package(
    artifact: Any,
    graph: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    standard: bytes,
    guards: str = "",
) -> PieceFile:
    """The piece file for a fresh standalone-compile ``artifact`` of ``graph`` (``guards``: what
    the compile assumed of its inputs)."""
    returns_tuple = _graph_returns_tuple(graph)
    compiled = _compat.find_compiled_graph(artifact)
    source = compiled.source_code if compiled is not None else ""
    partitions = len(re.findall(r"^def partition_\d+\(", source, re.MULTILINE))
    try:
        direct = extract_direct(artifact, graph, example_inputs)
    except NotDirect as e:
        log.debug("piece loads through Inductor only: %s", e)
        return PieceFile(standard, None, returns_tuple, str(e), partitions, guards)
    return PieceFile(standard, direct, returns_tuple, partitions=partitions, guards=guards)


def extract_direct(artifact: Any, graph: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> DirectCode:
    """Inductor's wrapper code and kernel libraries for ``artifact``; NotDirect says why not."""
    _check_inference_inputs(example_inputs)
    compiled = _compat.find_compiled_graph(artifact)
    if compiled is None:
        raise NotDirect("no Inductor output code found in the artifact")
    devices = set(getattr(compiled, "device_types", ()) or ())
    if devices - {"cpu"}:
        raise NotDirect(f"kernels for {sorted(devices)} (only CPU kernels load directly)")
    source = compiled.source_code
    call = compiled.current_callable
    namespace = getattr(call, "__globals__", None) or getattr(
        getattr(call, "__func__", None), "__globals__", None
    )
    if not isinstance(namespace, dict):
        raise NotDirect("the output module's globals are not reachable")
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    kernel_names = _rebind_imports(tree, lines)
    kernels = {}
    for name, kernel_source in kernel_names.items():
        library = _library_file(namespace.get(name), name)
        kernels[_sha(kernel_source)] = library.read_bytes()
    num_inputs, num_outputs = _call_arity(tree)
    expected_inputs = sum(1 for n in graph.graph.nodes if n.op == "placeholder")
    if num_inputs != expected_inputs or num_outputs != _graph_outputs(graph):
        raise NotDirect(
            f"the compiled code takes {num_inputs} and returns {num_outputs} values, the piece "
            f"{expected_inputs} and {_graph_outputs(graph)}: AOTAutograd wraps it"
        )
    wrapper = "".join(lines)
    return DirectCode(
        wrapper=wrapper,
        kernels=tuple(sorted(kernels.items())),
        extern=_extern_names(tree),
        num_inputs=num_inputs,
        num_outputs=num_outputs,
        code=marshal.dumps(compile(wrapper, _PIECE_FILE, "exec")),
        bytecode=BYTECODE,
    )


def _check_inference_inputs(example_inputs: Sequence[Any]) -> None:
    for value in example_inputs:
        if not isinstance(value, torch.Tensor):
            continue
        if type(value).__name__ not in ("Tensor", "FakeTensor", "Parameter"):
            raise NotDirect(f"a {type(value).__name__} input (tensor subclasses need AOTAutograd)")
        if value.requires_grad and torch.is_grad_enabled():
            raise NotDirect("compiled for autograd (an input requires grad under grad mode)")
    if torch.is_autocast_enabled():
        raise NotDirect("compiled under autocast")


def _rebind_imports(tree: ast.Module, lines: list[str]) -> dict[str, str]:
    """Point the wrapper's Inductor imports at ``Runtime``; return its kernels (name -> C++ source)."""
    kernels: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if module and module.startswith(("torch._inductor", "torch._dynamo")):
                if not isinstance(node, ast.ImportFrom):
                    raise NotDirect(f"the output code imports {module}")
                rebound = []
                for alias in node.names:
                    if alias.name not in RUNTIME_NAMES:
                        raise NotDirect(f"the output code imports {alias.name} from {module}")
                    rebound.append(f"{alias.asname or alias.name} = __tessera_runtime__.{alias.name}")
                _replace_lines(lines, node, "; ".join(rebound) + "\n")
        elif isinstance(node, ast.Assign) and _is_async_compile_call(node.value):
            call = node.value
            assert isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute), "checked above"
            if call.func.attr != "cpp_pybinding" or len(node.targets) != 1 or len(call.args) != 2:
                raise NotDirect(f"the output code builds a kernel with async_compile.{call.func.attr}")
            target, source = node.targets[0], call.args[1]
            if not (
                isinstance(target, ast.Name)
                and isinstance(source, ast.Constant)
                and isinstance(source.value, str)
            ):
                raise NotDirect("a kernel definition has an unexpected form")
            kernels[target.id] = source.value
    for found in ast.walk(tree):
        called = found.func.id if isinstance(found, ast.Call) and isinstance(found.func, ast.Name) else None
        if called in ("run_intermediate_hooks", "align"):
            raise NotDirect(f"the output code calls {called} (debug hooks or memory planning)")
    return kernels


def _is_async_compile_call(value: ast.AST) -> bool:
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and isinstance(value.func.value, ast.Name)
        and value.func.value.id == "async_compile"
    )


def _replace_lines(lines: list[str], node: ast.stmt, text: str) -> None:
    first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
    lines[first] = text
    for i in range(first + 1, last + 1):
        lines[i] = "\n"


def _library_file(kernel: Any, name: str) -> Path:
    module = getattr(kernel, "__self__", None)
    path = getattr(module, "__file__", None)
    if not isinstance(module, types.ModuleType) or not path or not os.path.isfile(path):
        raise NotDirect(f"kernel {name} is not a loaded extension library")
    return Path(path)


def _extern_names(tree: ast.Module) -> tuple[tuple[str, str], ...]:
    used = sorted(
        {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "extern_kernels"
        }
    )
    if not used:
        return ()
    namespace = _compat.extern_kernels()
    out = []
    for name in used:
        value = getattr(namespace, name, None)
        if value is None or getattr(torch, name, None) is not value:
            raise NotDirect(f"extern kernel {name} is not a torch function")
        out.append((name, name))
    return tuple(out)


def _call_arity(tree: ast.Module) -> tuple[int, int]:
    """How many inputs the output code's ``call(args)`` unpacks and how many values it returns."""
    call = None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "call":
            call = node
    if call is None:
        raise NotDirect("the output code has no call()")
    first = next((s for s in call.body if not isinstance(s, ast.Expr)), None)
    if isinstance(first, ast.Assign) and isinstance(first.targets[0], ast.Tuple):
        num_inputs = len(first.targets[0].elts)
    elif isinstance(first, ast.Assign) and isinstance(first.targets[0], ast.Name):
        num_inputs = 1
    else:
        raise NotDirect("call() does not start by unpacking its inputs")
    returns = [n for n in ast.walk(call) if isinstance(n, ast.Return)]
    if len(returns) != 1 or not isinstance(returns[0].value, (ast.Tuple, ast.List)):
        raise NotDirect("call() does not return one tuple")
    return num_inputs, len(returns[0].value.elts)


def _graph_outputs(graph: torch.fx.GraphModule) -> int:
    output = next(iter(reversed(graph.graph.nodes)))
    returned = output.args[0]
    return len(returned) if isinstance(returned, (tuple, list)) else 1


def _graph_returns_tuple(graph: torch.fx.GraphModule) -> bool:
    output = next(iter(reversed(graph.graph.nodes)))
    return isinstance(output.args[0], (tuple, list))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- warm: run the direct code --------------------------------------------------------------------
class Runtime:
    """What Inductor's CPU wrapper code imports from Inductor, served without importing it."""

    def __init__(self, kernels: dict[str, Callable[..., Any]], extern: Sequence[tuple[str, str]]) -> None:
        self._kernels = kernels
        self.extern_kernels = types.SimpleNamespace(**{name: getattr(torch, attr) for name, attr in extern})
        runtime = self

        class AsyncCompile:
            def cpp_pybinding(self, argtypes: Sequence[str], source: str) -> Callable[..., Any]:
                return runtime._kernels[_sha(source)]

            def wait(self, scope: dict[str, Any]) -> None:
                pass

        self.AsyncCompile = AsyncCompile

    @staticmethod
    def run_intermediate_hooks(*args: Any) -> None:
        raise AssertionError("tessera refuses direct code that calls Inductor's debug hooks")

    @staticmethod
    def _align(*args: Any) -> int:
        raise AssertionError("tessera refuses direct code that uses Inductor's memory planning")

    @staticmethod
    @contextlib.contextmanager
    def maybe_profile(*args: Any, **kwargs: Any) -> Any:
        yield


def load_direct(direct: DirectCode, name: str) -> Callable[..., Any]:
    """The piece's ``call`` as a function of the piece's inputs; returns its outputs as a tuple."""
    kernels = {sha: _load_library(data) for sha, data in direct.kernels}
    namespace: dict[str, Any] = {
        "__name__": f"tessera_piece_{name}",
        "__tessera_runtime__": Runtime(kernels, direct.extern),
    }
    filename = f"<tessera piece {name}>"
    # Tracebacks through the piece show its lines (Inductor registers its files the same way).
    linecache.cache[filename] = (len(direct.wrapper), None, direct.wrapper.splitlines(True), filename)
    exec(_wrapper_code(direct, filename), namespace)
    call = namespace["call"]

    def run(*args: Any) -> Any:
        return call(list(args))

    return run


_PIECE_FILE = "<tessera piece>"  # the file name compiled in; the piece's own replaces it at load


def _wrapper_code(direct: DirectCode, filename: str) -> types.CodeType:
    """The wrapper's code, named ``filename``: the code compiled with it where its bytecode version
    is this interpreter's, else the wrapper compiled now. The file is the cache's, as trusted as
    the wrapper it carries (both are run)."""
    if direct.code and direct.bytecode == BYTECODE:
        try:
            code = marshal.loads(direct.code)
        except (ValueError, EOFError, TypeError) as e:
            log.debug("a piece's compiled wrapper does not unmarshal (%s); compiling it", e)
        else:
            if isinstance(code, types.CodeType):
                return _renamed(code, filename)
    return compile(direct.wrapper, filename, "exec")


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and the functions in it with ``filename`` as their file (tracebacks, linecache)."""
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def _load_library(data: bytes) -> Any:
    """The kernel in a shared library held in memory (memfd on Linux, else a private temp file)."""
    sha = hashlib.sha256(data).hexdigest()
    module = _LIBRARIES.get(sha)
    if module is None:
        os.environ.update(_compat.kernel_env())
        path = _library_path(sha, data)
        name = f"tessera_kernel_{sha[:24]}.kernel"  # Inductor's libraries export PyInit_kernel
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        spec = importlib.util.spec_from_loader(name, loader, origin=path)
        assert spec is not None, "spec_from_loader returned None for an extension loader"
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        _LIBRARIES[sha] = module
    return module.kernel


def _library_path(sha: str, data: bytes) -> str:
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        fd = memfd_create(f"tessera-{sha[:16]}", 0)  # kept open for the life of the process
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(data)
        return f"/proc/self/fd/{fd}"
    directory = tempfile.mkdtemp(prefix="tessera-kernels-")  # 0700: only this user reads it
    path = os.path.join(directory, f"{sha[:32]}.so")
    with open(path, "wb") as f:
        f.write(data)
    return path
