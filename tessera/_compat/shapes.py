"""A trace's symbolic sizes, read out of its shape env and made again in another process's.

Part of tessera._compat (see its docstring): the names are used as ``_compat.<name>``. Used by
symbolic_inputs.py, which sends a general compile to a compile worker: the worker needs the
piece's example inputs with the trace's size symbols, their hints and their ranges.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tessera._compat.tensors import backed_hints


def symbol_facts(symint: torch.SymInt) -> dict[Any, tuple[int, int | None, int | None]] | None:
    """Each free symbol of ``symint``'s expression: ``(hint, lower, upper)`` (None: no bound).
    None when one has no hint (an unbacked symbol: its value is data, not a size).

    Checked on torch 2.11, 2.13: private ``SymNode.shape_env``, ``ShapeEnv.var_to_range`` and
    ``backed_var_to_val`` (``var_to_val`` before 2.13); no public accessor of a symbol's range.
    """
    node = symint.node
    shape_env = getattr(node, "shape_env", None)
    if shape_env is None:
        return None
    hints = backed_hints(shape_env)
    if hints is None:
        return None
    ranges = shape_env.var_to_range
    facts: dict[Any, tuple[int, int | None, int | None]] = {}
    for symbol in node.expr.free_symbols:
        hint = hints.get(symbol)
        if hint is None:
            return None
        found = ranges.get(symbol)
        lower = _bound(found.lower) if found is not None else None
        upper = _bound(found.upper) if found is not None else None
        facts[symbol] = (int(hint), lower, upper)
    return facts


def symbol_knowledge(values: Any) -> list[str]:
    """What the shape env of ``values`` (fake tensors and SymInts, as a graph's inputs) knows of
    their symbols beyond their names: each symbol's range, and every guard over those symbols
    alone, as sorted text. Code compiled for the same graph under other ranges or guards may
    differ (Inductor simplifies with them: a slice ``x[-15:]`` of a size known to be at most 14
    is all of ``x``), so two graphs are one only where this is equal too.

    Checked on torch 2.13 (2.15: not yet): private ``ShapeEnv.var_to_range`` and ``ShapeEnv.guards`` (each
    with ``.expr``), reached through ``SymNode.shape_env`` / ``FakeTensor.fake_mode``; no public
    view of a trace's symbol ranges and guards."""
    shape_env = None
    symbols: set[Any] = set()

    def take(value: Any) -> None:
        nonlocal shape_env
        if isinstance(value, torch.SymInt):
            node = value.node
            shape_env = shape_env or getattr(node, "shape_env", None)
            symbols.update(getattr(node.expr, "free_symbols", ()))

    for value in values:
        if isinstance(value, torch.Tensor):
            for size in (*value.shape, *value.stride(), value.storage_offset()):
                take(size)
        else:
            take(value)
    if shape_env is None or not symbols:
        return []
    facts = []
    for symbol in sorted(symbols, key=str):
        found = shape_env.var_to_range.get(symbol)
        if found is not None:
            facts.append(f"{symbol} in [{_bound(found.lower)}, {_bound(found.upper)}]")
    for guard in getattr(shape_env, "guards", ()):
        expr = getattr(guard, "expr", None)
        free = getattr(expr, "free_symbols", None)
        if free and free <= symbols:
            facts.append(f"guard {expr}")
    return sorted(set(facts))


# Each trace's shape env, with how many guards it held when its call check was made: what a later
# compile adds to it is an assumption of that compile only (``compile_assumptions``).
# Checked on torch 2.13: keys are private ``ShapeEnv`` objects (weakly referable); no public handle.
_AT_TRACE: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _shape_env_of(values: Any) -> Any:
    """The shape env of the first SymInt among ``values`` (fake tensors' sizes and strides, SymInts).

    Checked on torch 2.13: private ``SymNode.shape_env``; no public accessor."""
    for value in values:
        sizes = (*value.shape, *value.stride()) if isinstance(value, torch.Tensor) else (value,)
        for size in sizes:
            if isinstance(size, torch.SymInt):
                shape_env = getattr(size.node, "shape_env", None)
                if shape_env is not None:
                    return shape_env
    return None


def note_trace(values: Any) -> None:
    """Mark the guards the shape env of ``values`` (a trace's example inputs) holds now as the
    trace's own: its call check holds them, so a compile need not say them again.

    Checked on torch 2.13: private ``ShapeEnv.guards``."""
    shape_env = _shape_env_of(values)
    if shape_env is not None:
        _AT_TRACE.setdefault(shape_env, len(shape_env.guards))


def guard_baseline(values: Any) -> int:
    """Where the guards a compile of a graph with inputs ``values`` adds begin: the trace's count
    where ``note_trace`` marked its shape env, else (a shape env made for one compile) the count
    now. Taken before the compile, handed to ``compile_assumptions`` after it.

    Checked on torch 2.13: private ``ShapeEnv.guards``."""
    shape_env = _shape_env_of(values)
    if shape_env is None:
        return 0
    return _AT_TRACE.get(shape_env, len(shape_env.guards))


def compile_assumptions(values: Any, baseline: int) -> str | None:
    """What a compile of a graph with inputs ``values`` (fake tensors, SymInts) assumed of their
    sizes beyond what its trace checks: the guards its shape env gained after ``baseline`` over
    those inputs' symbols, and every size a guard fixed to a number, as one Python expression over
    ``L['t0']``, ``L['t1']``, ... (the inputs by position; ``guard_names`` holds what it calls).
    None when it assumed nothing. Raises ValueError where a guard cannot be written over them.

    Inductor simplifies with what it asks of the sizes (``Eq(s3, 14)`` at a window's edge,
    ``Ne(16*s3 + 16, 240)``): its code is then right for the inputs that hold those facts only.

    Checked on torch 2.13 (2.15: not yet): private ``ShapeEnv.guards``, ``ShapeEnv.simplify``,
    ``ShapeEnv.produce_guards`` with ``guards=``, ``SymNode.expr`` and Dynamo's ``LocalSource``;
    no public way to ask what a compile assumed of its inputs."""
    shape_env = _shape_env_of(values)
    if shape_env is None:
        return None
    from torch._dynamo.source import LocalSource

    placeholders, sources, fixed = [], [], []
    symbols: set[Any] = set()
    for i, value in enumerate(values):
        if not isinstance(value, torch.Tensor | torch.SymInt):
            continue
        name = f"L['t{i}']"
        placeholders.append(value)
        sources.append(LocalSource(f"t{i}"))
        if isinstance(value, torch.SymInt):
            parts: list[tuple[str, Any]] = [(name, value)]
        else:
            parts = [(f"{name}.size()[{d}]", s) for d, s in enumerate(value.shape)]
            parts += [(f"{name}.stride()[{d}]", s) for d, s in enumerate(value.stride())]
            parts.append((f"{name}.storage_offset()", value.storage_offset()))
        for text, size in parts:
            if not isinstance(size, torch.SymInt):
                continue  # static in the trace: its call check holds it
            expr = size.node.expr
            if expr.is_number:  # symbolic in the trace, fixed since by a guard
                fixed.append(f"{text} == {int(expr)}")
            else:
                symbols.update(expr.free_symbols)
    added = []
    for guard in shape_env.guards[baseline:]:
        free = shape_env.simplify(guard.expr).free_symbols
        if free and free <= symbols:  # about these inputs (another piece's guards are its own)
            added.append(guard)
    produced: list[str] = []
    if added:
        try:
            produced = list(shape_env.produce_guards(placeholders, sources, guards=added))
        except Exception as e:  # any failure to print: not writable over these inputs
            raise ValueError(f"{type(e).__name__}: {e}") from e
    facts = [*fixed, *produced]
    return " and ".join(f"({fact})" for fact in facts) if facts else None


def guard_check(expression: str) -> Callable[[tuple[Any, ...]], bool]:
    """``expression`` (from ``compile_assumptions``) as a function of a call's inputs (a tuple).

    Checked on torch 2.13: private ``torch.fx.experimental.symbolic_shapes.SYMPY_INTERP``, the
    names Dynamo evaluates such guards with (``Min``, ``FloorDiv``, ...)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    body = re.sub(r"L\['t(\d+)'\]", r"_a[\1]", expression)
    # Text tessera wrote itself (compile_assumptions), read from a piece file the cache trusts.
    holds: Callable[[tuple[Any, ...]], bool] = eval(f"lambda _a: bool({body})", dict(SYMPY_INTERP))
    return holds


def _bound(value: Any) -> int | None:
    """A range's bound as an int; None for int_oo and sympy's infinities (no bound).

    Checked on torch 2.11, 2.13: a bound of the private ``ValueRanges`` is a sympy number, its
    infinity torch's own ``int_oo`` (not an Integer); no public range type."""
    import sympy

    if isinstance(value, int | sympy.Integer):
        return int(value)
    return None


class SymbolMaker:
    """A fresh fake-tensor mode with a shape env of its own, in which the symbols of another
    process's trace are made again (``symbol``) and expressions over them made into SymInts.

    Checked on torch 2.11, 2.13: private ``ShapeEnv.create_symbol`` / ``create_symintnode`` /
    ``constrain_symbol_range`` / ``var_to_range``, ``DimDynamic``, ``ConstantSource``, ``int_oo``
    and ``FakeTensorMode``; no public way to make a size symbol with a given hint and range."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        self.shape_env = ShapeEnv()
        self.mode = FakeTensorMode(shape_env=self.shape_env)

    def symbol(self, name: str, hint: int, lower: int | None, upper: int | None) -> Any | None:
        """A new symbol standing for the trace's ``name``, with its hint and exactly its range;
        None when the shape env cannot make that (the compile must not assume what the trace did
        not: a range narrowed to ``>= 2`` would let Inductor drop the code for a size of 1)."""
        import sympy
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic
        from torch.utils._sympy.numbers import int_oo

        if lower is None or lower < 0:  # an int argument, not a size: sizes are made >= 0
            return None
        # Made with the widest range (no 0/1 specialization), then narrowed to the trace's.
        made = self.shape_env.create_symbol(
            hint, ConstantSource(f"tessera_{name}"), DimDynamic.DYNAMIC, do_not_specialize_zero_one=True
        )
        if not isinstance(made, sympy.Symbol):
            return None
        self.shape_env.constrain_symbol_range(made, lower, upper if upper is not None else int_oo)
        found = self.shape_env.var_to_range[made]
        if (_bound(found.lower), _bound(found.upper)) != (lower, upper):
            return None
        return made

    def symint(self, expr: Any, hint: int) -> torch.SymInt:
        return self.shape_env.create_symintnode(expr, hint=hint)  # type: ignore[return-value]

    def propagate(self, graph: torch.fx.GraphModule, inputs: list[Any]) -> None:
        """Run ``graph`` on the fake ``inputs``, leaving each node's fake value in its meta, as a
        Dynamo graph carries them (``val`` and ``example_value``): what Inductor's compile of a
        graph with its own symbolic shapes reads them from.

        Checked on torch 2.11, 2.13: ``torch.fx.passes.fake_tensor_prop.FakeTensorProp`` (not
        marked backward compatible) and the meta keys Dynamo and ``standalone_compile`` use; no
        public way to give a graph its fake values."""
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp

        FakeTensorProp(graph, self.mode).propagate_dont_convert_inputs(*inputs)
        for node in graph.graph.nodes:
            if "val" in node.meta:
                node.meta["example_value"] = node.meta["val"]
