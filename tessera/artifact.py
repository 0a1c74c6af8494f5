"""The whole-model artifact: what rebuilds a compiled model in a new process without Dynamo.

It holds Dynamo's transformed bytecode, the split module and each piece's dispatch record; a
fingerprint of the model, its inputs and the process state finds it before anything is traced.
"""

from __future__ import annotations

import dataclasses
import dis
import hashlib
import importlib
import json
import logging
import marshal
import pickle
import platform
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera.cache import MODEL, atomic_write, rank_dir, report_damage, sha256_file
from tessera.cachekey import SourceFile
from tessera.config import CompileConfig, SizeRange
from tessera.layout import OutputLayout
from tessera.piece import PieceRecord

log = logging.getLogger(__name__)

WARM_DIR = "warm"
FORMAT = 2


@dataclass(frozen=True)
class ModelArtifact:
    """Everything but the piece artifacts (those stay content-addressed in the entry)."""

    format: int
    python: str
    code: bytes  # marshal of Dynamo's transformed code object
    compiled_fn: str  # the global name that code calls with the graph inputs
    imports: tuple[tuple[str, str], ...]  # (global name, module) pairs the code reads
    split_module: bytes  # pickle of the split GraphModule (pieces as plain submodules)
    pieces: tuple[PieceRecord, ...]
    splitting: tuple[str, ...]  # names of the splitting pieces
    layouts: tuple[tuple[str, OutputLayout | None], ...]  # splitting piece -> output strides
    sources: tuple[SourceFile, ...]


class WarmStartUnavailable(Exception):
    """The Dynamo-free path cannot be used this time; the caller takes the normal path."""


# -- fingerprint -------------------------------------------------------------------------------
def _simple(value: Any, depth: int = 0) -> Any:
    """A stable description of an attribute value, or None when it has no stable one."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (tuple, list)) and depth < 3:
        return [_simple(v, depth + 1) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        text = repr(value)
        return None if " at 0x" in text else text
    to_dict = getattr(value, "to_dict", None)  # Hugging Face configs
    if callable(to_dict):
        try:
            return json.dumps(to_dict(), sort_keys=True, default=str)
        except (TypeError, ValueError):
            return None
    return None


def _module_state(model: torch.nn.Module) -> list[Any]:
    state: list[Any] = []
    for name, module in model.named_modules():
        attrs = {k: _simple(v) for k, v in vars(module).items() if not k.startswith("_")}
        state.append((name, type(module).__qualname__, module.training, sorted(attrs.items())))
        for pname, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is not None:
                state.append((f"{name}.{pname}", tuple(tensor.shape), str(tensor.dtype), str(tensor.device)))
    return state


def _input_signature(values: Mapping[str, Any], marked: Sequence[tuple[str, int]]) -> list[Any]:
    dynamic = set(marked)
    out: list[Any] = []
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            shape = ["*" if (name, d) in dynamic else s for d, s in enumerate(value.shape)]
            out.append((name, "tensor", str(value.dtype), str(value.device), shape, value.requires_grad))
        else:
            out.append((name, type(value).__qualname__, _simple(value)))
    return out


def fingerprint(
    func: types.FunctionType,
    bound_to: object | None,
    arguments: Mapping[str, Any],
    marked: Sequence[tuple[str, int]],
    config: CompileConfig,
    compiler_hash: str,
    prefix: str,
) -> str:
    """sha256 over all that decides the traced graph and is known before tracing."""
    code = func.__code__
    factors = {
        "format": FORMAT,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "function": [func.__module__, func.__qualname__, Path(code.co_filename).name],
        "code": hashlib.sha256(marshal.dumps(code)).hexdigest(),
        "closure": [_simple(c.cell_contents) for c in (func.__closure__ or ())],
        "defaults": _simple(func.__defaults__),
        "model": _module_state(bound_to) if isinstance(bound_to, torch.nn.Module) else repr(type(bound_to)),
        "inputs": _input_signature(arguments, marked),
        "state": [torch.is_grad_enabled(), str(torch.get_default_dtype()), torch.is_autocast_enabled()],
        "config": config.compute_hash(),
        "compiler": compiler_hash,
        "where": [prefix, rank_dir()],
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()


# -- capture (after a Dynamo trace) ---------------------------------------------------------------
def capture(
    code: types.CodeType,
    func: types.FunctionType,
    split_gm: torch.fx.GraphModule,
    pieces: Sequence[PieceRecord],
    splitting: Sequence[str],
    sources: Sequence[SourceFile],
    layouts: Mapping[str, OutputLayout | None],
) -> ModelArtifact | None:
    """The artifact for a finished trace, or None when its bytecode needs globals we cannot rebuild."""
    compiled_fn = None
    imports = []
    for instruction in dis.get_instructions(code):
        if instruction.opname != "LOAD_GLOBAL":
            continue
        name = instruction.argval
        value = func.__globals__.get(name)
        if name.startswith("__compiled_fn"):
            compiled_fn = name
        elif isinstance(value, types.ModuleType):
            imports.append((name, value.__name__))
        elif name.startswith("__") and name not in func.__globals__.get("__builtins__", {}):
            log.debug("no whole-model artifact: bytecode reads Dynamo global %s", name)
            return None
    if compiled_fn is None:
        return None
    clean = torch.fx.GraphModule(dict(split_gm.named_children()), split_gm.graph)
    try:
        code_bytes = marshal.dumps(code)
        split_bytes = pickle.dumps(clean)
    except Exception as e:  # an object constant in the bytecode or graph: per-piece cache only
        log.info("no whole-model artifact (warm starts will trace): %s", e)
        return None
    return ModelArtifact(
        format=FORMAT,
        python=platform.python_version(),
        code=code_bytes,
        compiled_fn=compiled_fn,
        imports=tuple(dict.fromkeys(imports)),
        split_module=split_bytes,
        pieces=tuple(dataclasses.replace(p, served=()) for p in pieces),
        splitting=tuple(splitting),
        layouts=tuple(layouts.items()),
        sources=tuple(sources),
    )


def save(entry_path: Path, artifact: ModelArtifact) -> tuple[str, int]:
    """Write the artifact into its entry; return its sha256 and size for the index."""
    path = entry_path / MODEL
    atomic_write(path, pickle.dumps(artifact, protocol=pickle.HIGHEST_PROTOCOL))
    return sha256_file(path), path.stat().st_size


def pointer_path(root: Path, print_: str) -> Path:
    return root / WARM_DIR / f"{print_[:32]}.json"


def write_pointer(root: Path, print_: str, entry_path: Path) -> None:
    """Record which entry this fingerprint leads to (path relative to the root)."""
    relative = entry_path.relative_to(root).as_posix()
    atomic_write(pointer_path(root, print_), json.dumps({"entry": relative}).encode())


def read_pointer(root: Path, print_: str) -> Path | None:
    path = pointer_path(root, print_)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        relative = Path(data["entry"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        report_damage(path, f"unreadable ({type(e).__name__})")
        raise WarmStartUnavailable(f"{path} is unreadable") from e
    if relative.is_absolute() or ".." in relative.parts:
        raise WarmStartUnavailable(f"{path} points outside the cache")
    return root / relative


def load(entry_path: Path) -> ModelArtifact:
    """Unpickle the artifact (its checksum was verified by the caller) and check it fits here."""
    try:
        artifact = pickle.loads((entry_path / MODEL).read_bytes())
    except Exception as e:
        raise WarmStartUnavailable(f"{MODEL} does not load ({type(e).__name__})") from e
    if not isinstance(artifact, ModelArtifact) or artifact.format != FORMAT:
        raise WarmStartUnavailable(f"{MODEL} has another format")
    if artifact.python != platform.python_version():
        raise WarmStartUnavailable("the artifact's bytecode is for another Python")
    for source in artifact.sources:
        try:
            if sha256_file(Path(source.path)) != source.sha256:
                raise WarmStartUnavailable(f"{source.path} changed since the artifact was made")
        except OSError as e:
            raise WarmStartUnavailable(f"{source.path} is not readable") from e
    return artifact


def rebuild_call(
    artifact: ModelArtifact,
    func: types.FunctionType,
    bound_to: object | None,
    graph_callable: Callable[..., Any],
) -> Callable[..., Any]:
    """Dynamo's bytecode as a plain function again, calling ``graph_callable`` for the graph."""
    code = marshal.loads(artifact.code)
    if code.co_freevars != func.__code__.co_freevars:
        raise WarmStartUnavailable("the function's closure changed shape")
    namespace = func.__globals__
    for name, module in artifact.imports:
        namespace[name] = importlib.import_module(module)
    # Dynamo installs its compiled graph the same way: a uniquely named global of the module.
    namespace[artifact.compiled_fn] = graph_callable
    fast = types.FunctionType(code, namespace, func.__name__, func.__defaults__, func.__closure__)
    fast.__kwdefaults__ = func.__kwdefaults__
    return types.MethodType(fast, bound_to) if bound_to is not None else fast


def piece_sizes(record: PieceRecord) -> list[int | SizeRange | None]:
    """Every size a piece holds an artifact for, general first (the order the backend compiles)."""
    return [None, *record.sizes, *record.ranges]
