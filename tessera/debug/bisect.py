"""Numerical bisection: which compiled piece changed the numbers, and by how much.

The split module runs eagerly on the call's graph inputs; at every compiled piece the compiled
artifact runs too, on that piece's *eager* inputs, and its outputs are compared with the eager
piece's. Errors do not propagate, so the first piece over the tolerance is the culprit, named with
the source lines it came from and the code that served it.
"""

from __future__ import annotations

import dataclasses
import dis
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from tessera import _compat


@dataclass(frozen=True)
class PieceError:
    """One output of one compiled piece against eager, fed the same (eager) inputs."""

    piece: str
    output: int
    max_abs: float
    max_rel: float
    within: bool
    source_lines: tuple[str, ...]  # "file:line: code" of the model code the piece came from
    code: str  # where the compiled code is: the cache file, or "in memory"


@dataclass(frozen=True)
class BisectReport:
    errors: tuple[PieceError, ...]
    atol: float
    rtol: float

    @property
    def first_bad(self) -> PieceError | None:
        """The first piece (in execution order) whose error exceeds the tolerance."""
        return next((e for e in self.errors if not e.within), None)

    def format(self) -> list[str]:
        lines = [f"{'piece':<12} {'out':>3} {'max abs':>11} {'max rel':>11}  within tolerance"]
        for e in self.errors:
            verdict = "yes" if e.within else "NO"
            lines.append(f"{e.piece:<12} {e.output:>3} {e.max_abs:>11.3e} {e.max_rel:>11.3e}  {verdict}")
        bad = self.first_bad
        lines.append(f"tolerance: atol={self.atol}, rtol={self.rtol}")
        if bad is None:
            lines.append("every compiled piece is within tolerance")
        else:
            lines.append(f"first piece over tolerance: {bad.piece} (output {bad.output}), code: {bad.code}")
            lines.extend(f"  from {line}" for line in bad.source_lines)
        return lines


def bisect(
    model: Any, compiled: Any, *args: Any, atol: float = 1e-4, rtol: float = 1e-4, **kwargs: Any
) -> BisectReport:
    """Compare ``compiled`` (a ``tessera.compile`` of ``model``) with eager, piece by piece.

    ``args``/``kwargs`` are one call of the model. A warm-started ``compiled`` has no traced graph
    in this process; the split structure then comes from a trace with the eager compiler.
    """
    with torch.no_grad():
        if compiled.report is None:
            compiled(*args, **kwargs)
        reference = compiled
        if compiled.split_graph is None or compiled.trace_code is None:
            # The same split, traced with the eager compiler (graph partition: one piece).
            config = dataclasses.replace(
                compiled.compile_config,
                backend="eager",
                disable_cache=True,
                passes=(),
                graph_partition=False,
                mode="trace_once"
                if compiled.compile_config.graph_partition
                else compiled.compile_config.mode,
            )
            # The compiled model's own class, built as tessera.compile builds it (the config is a
            # checked one, changed only where it is known good): debug/ stands beside the API.
            reference = type(compiled)(model, config, compiled.dynamic_dims, None)
            reference(*args, **kwargs)
        split_gm, code = reference.split_graph, reference.trace_code
        assert split_gm is not None and code is not None, "the reference compile traced nothing"
        runners = compiled.runners
        comparer = _Comparer(split_gm, runners, atol, rtol, _code_paths(compiled))
        _run_bytecode(code, reference.entry_frame, comparer.run, reference.target, args, kwargs)
    return BisectReport(tuple(comparer.errors), atol, rtol)


def _run_bytecode(
    code: types.CodeType,
    entry: types.FunctionType,
    graph: Any,
    target: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> Any:
    """Dynamo's bytecode for the call, with its compiled graph replaced by ``graph``."""
    name = next(
        i.argval
        for i in dis.get_instructions(code)
        if i.opname == "LOAD_GLOBAL" and str(i.argval).startswith(_compat.COMPILED_FN_PREFIX)
    )
    namespace = dict(entry.__globals__)
    namespace[name] = graph
    return types.FunctionType(code, namespace, "tessera_bisect")(target, *args, **kwargs)


class _Comparer(torch.fx.Interpreter):
    """Runs the split module eagerly; at each compiled piece, also the compiled artifact."""

    def __init__(
        self,
        split_gm: torch.fx.GraphModule,
        runners: dict[str, Any],
        atol: float,
        rtol: float,
        code_paths: dict[str, str],
    ) -> None:
        super().__init__(split_gm)
        self.runners = runners
        self.atol, self.rtol = atol, rtol
        self.code_paths = code_paths
        self.errors: list[PieceError] = []
        self.children: dict[str, Any] = dict(split_gm.named_children())

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        piece = self.children[str(target)]
        runner = self.runners.get(str(target))
        if runner is None:  # a splitting piece: eager in both
            return piece(*args, **kwargs)
        compiled_out = runner(*_clone(args))  # its own copies: pieces may write their inputs
        eager_out = piece.forward(*args)
        self._compare(str(target), piece, eager_out, compiled_out)
        return eager_out

    def _compare(self, name: str, piece: torch.fx.GraphModule, eager: Any, compiled: Any) -> None:
        eager_list = list(eager) if isinstance(eager, (tuple, list)) else [eager]
        compiled_list = list(compiled) if isinstance(compiled, (tuple, list)) else [compiled]
        lines = _source_lines(piece)
        for i, (e, c) in enumerate(zip(eager_list, compiled_list, strict=False)):
            if not (isinstance(e, torch.Tensor) and isinstance(c, torch.Tensor)):
                continue
            if e.shape != c.shape or not (e.is_floating_point() or e.is_complex()):
                same = e.shape == c.shape and bool((e == c).all())
                error = 0.0 if same else float("inf")
                self.errors.append(PieceError(name, i, error, 0.0, same, lines, self._code(name)))
                continue
            diff = (e.double() - c.double()).abs()
            max_abs = float(diff.max()) if diff.numel() else 0.0
            scale = e.double().abs()
            max_rel = float((diff / scale.clamp_min(1e-12)).max()) if diff.numel() else 0.0
            within = bool((diff <= self.atol + self.rtol * scale).all())
            self.errors.append(PieceError(name, i, max_abs, max_rel, within, lines, self._code(name)))

    def _code(self, name: str) -> str:
        return self.code_paths.get(name, "in memory")


def _clone(args: Sequence[Any]) -> list[Any]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _source_lines(piece: torch.fx.GraphModule, limit: int = 6) -> tuple[str, ...]:
    """The model code a piece came from: the innermost frame of each node's stack trace."""
    found: list[str] = []
    for node in piece.graph.nodes:
        entry = _innermost_frame(node.meta.get("stack_trace") or "")
        if entry and entry not in found:
            found.append(entry)
    return tuple(found[:limit])


def _innermost_frame(trace: str) -> str:
    """``path:line in fn: code`` for the last ``File ...`` line of a stack trace ('' if none).

    Traces end with the code line and, on Python 3.11+, a line of carets under it.
    """
    lines = [line.strip() for line in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            where = lines[i].removeprefix("File ").replace('"', "")
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{where}: {code}"
    return ""


def _code_paths(compiled: Any) -> dict[str, str]:
    """Piece name -> the file its general artifact was loaded from or saved to."""
    report = compiled.report
    if report is None or report.cache_entry is None:
        return {}
    entry = report.cache_entry
    return {a.piece: f"{entry}/{a.file}" for a in report.artifacts if a.size == "general" and a.file}
