"""Cache key factors: what makes two compiles interchangeable, and how two sets of factors differ.

The key is sha256 over the factors; nothing that varies run to run (paths, pids, times) enters it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx

from tessera.config import CompileConfig

# TESSERA_* variables that change compiled code (the others: paths and switches, do not).
CODE_ENV_VARS = (
    "TESSERA_MODE",
    "TESSERA_BACKEND",
    "TESSERA_COMPILE_SIZES",
    "TESSERA_COMPILE_RANGES",
    "TESSERA_MAX_SIZE",
    "TESSERA_CUDAGRAPH_MODE",
    "TESSERA_CUDAGRAPH_CAPTURE_SIZES",
)
_TORCH_DIR = str(Path(torch.__file__).parent)


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
        out[name] = SourceFile(name, hashlib.sha256(Path(name).read_bytes()).hexdigest())
    return sorted(out.values(), key=lambda s: s.path)


def graph_signature(gm: torch.fx.GraphModule) -> str:
    """sha256 of the traced graph's code and its inputs' shapes, dtypes and devices."""
    parts = [gm.code]
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor):
                parts.append(f"{node.name}:{tuple(map(str, value.shape))}:{value.dtype}:{value.device}")
            else:
                parts.append(f"{node.name}:{type(value).__name__}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def collect_factors(
    config: CompileConfig,
    compiler_name: str,
    compiler_hash: str,
    sources: list[SourceFile],
    graph_hash: str,
) -> dict[str, Any]:
    """The raw factors, JSON-ready. Source files enter by content, under their base name only."""
    return {
        "env": {name: os.environ[name] for name in CODE_ENV_VARS if name in os.environ},
        "config": config.hash_factors(),
        "compiler": {"name": compiler_name, "hash": compiler_hash},
        "torch_version": torch.__version__,
        "graph": graph_hash,
        "sources": {Path(s.path).name + "@" + s.sha256[:12]: s.sha256 for s in sources},
    }


def compute_key(factors: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def factor_differences(
    new: Mapping[str, Any],
    old: Mapping[str, Any],
    new_sources: Mapping[str, str] | None = None,
    old_sources: Mapping[str, str] | None = None,
) -> list[str]:
    """Human-readable lines naming each factor that differs between two factor sets.

    ``*_sources`` map a source file's name to a snapshot of its text, for a diff summary.
    """
    lines: list[str] = []
    if new.get("torch_version") != old.get("torch_version"):
        lines.append(f"torch version: {old.get('torch_version')} -> {new.get('torch_version')}")
    elif new.get("compiler") != old.get("compiler"):
        lines.append("compiler: its hash changed (Inductor config, CUDA, device or Python)")
    for field in sorted(set(new.get("config", {})) | set(old.get("config", {}))):
        a, b = old.get("config", {}).get(field), new.get("config", {}).get(field)
        if a != b:
            lines.append(f"config field {field}: {a!r} -> {b!r}")
    for var in sorted(set(new.get("env", {})) | set(old.get("env", {}))):
        if new.get("env", {}).get(var) != old.get("env", {}).get(var):
            lines.append(f"environment {var}: {old['env'].get(var)!r} -> {new['env'].get(var)!r}")
    lines.extend(_source_differences(new, old, new_sources or {}, old_sources or {}))
    if new.get("graph") != old.get("graph") and not lines:
        lines.append("traced graph: the model's structure or parameter shapes changed")
    return lines


def _source_differences(
    new: Mapping[str, Any], old: Mapping[str, Any], new_text: Mapping[str, str], old_text: Mapping[str, str]
) -> list[str]:
    def by_name(factors: Mapping[str, Any]) -> dict[str, str]:
        return {key.rsplit("@", 1)[0]: sha for key, sha in factors.get("sources", {}).items()}

    lines = []
    a, b = by_name(old), by_name(new)
    for name in sorted(set(a) | set(b)):
        if name not in a:
            lines.append(f"source file {name}: newly traced")
        elif name not in b:
            lines.append(f"source file {name}: no longer traced")
        elif a[name] != b[name]:
            lines.append(
                f"source file {name}: content changed{_diff_summary(old_text.get(name), new_text.get(name))}"
            )
    return lines


def _diff_summary(old: str | None, new: str | None) -> str:
    if old is None or new is None:
        return ""
    diff = list(difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    first = next((line for line in diff if line.startswith("@@")), "")
    changed = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")][:4]
    shown = "; ".join(line.strip()[:80] for line in changed)
    return f" (+{added}/-{removed} lines, first hunk {first}: {shown})"
