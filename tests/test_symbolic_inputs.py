"""General compiles in a compile worker: a piece's symbolic example inputs described, pickled and
made again in a shape env of another process, with the same sizes, relations, hints and ranges,
and refused (compiled in the parent) where they cannot be."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

from tessera import _compat
from tessera.compilation.compile_jobs import example_inputs
from tessera.compilation.inductor_compiler import InductorCompiler
from tessera.compilation.symbolic_inputs import SymbolicInputs, SymbolicInt, SymbolSpec, describe, rebuild


def _traced(
    fn: Any, *args: Any, dynamic: dict[int, tuple[int, ...]]
) -> tuple[torch.fx.GraphModule, list[Any]]:
    """Dynamo's graph of ``fn`` and its fake inputs, with the given dims of each arg dynamic."""
    seen: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, _: list[Any]) -> Any:
        seen.append((gm, _compat.placeholder_values(gm)))
        return gm.forward

    for i, dims in dynamic.items():
        for dim in dims:
            torch._dynamo.mark_dynamic(args[i], dim)
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(seen) == 1
    return seen[0]


def _batch_by_length(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    b, n, d = x.shape
    flat = x.reshape(b * n, d) @ w  # the pieces of a batch x length model see b * n rows
    return flat.relu().reshape(b, n, -1) + x.sum(-1, keepdim=True)


def _expr(value: Any) -> Any:
    return _compat.sym_expr(value) if isinstance(value, torch.SymInt) else value


def test_inputs_are_made_again_with_their_sizes_relations_hints_and_ranges():
    x, w = torch.randn(3, 5, 4), torch.randn(4, 6)
    gm, fakes = _traced(_batch_by_length, x, w, dynamic={0: (0, 1)})
    spec = describe(fakes)
    assert spec is not None
    spec = pickle.loads(pickle.dumps(spec))  # it crosses a pipe
    assert sorted(s.hint for s in spec.symbols) == [3, 5]
    made = rebuild(spec, gm)
    tensors = [m for m in made if isinstance(m, torch.Tensor)]
    originals = [f for f in fakes if isinstance(f, torch.Tensor)]
    assert len(tensors) == len(originals) == 2
    for old, new in zip(originals, tensors, strict=True):
        # The same sizes at the hints, the same symbolic structure (batch x length stays a product
        # of two symbols, the weight stays static), in a shape env of its own.
        assert [_compat.size_hint(d) for d in new.shape] == [_compat.size_hint(d) for d in old.shape]
        assert [_compat.size_hint(d) for d in new.stride()] == [_compat.size_hint(d) for d in old.stride()]
        assert [isinstance(d, torch.SymInt) for d in new.shape] == [
            isinstance(d, torch.SymInt) for d in old.shape
        ]
        assert new.dtype == old.dtype and new.requires_grad == old.requires_grad
    x_new = tensors[0]
    assert _expr(x_new.stride(0)) == _expr(x_new.shape[1]) * 4  # the strides follow the sizes
    assert x_new.shape[0].node.shape_env is not originals[0].shape[0].node.shape_env
    # Ranges: each symbol's range in the new shape env is the trace's.
    for symbol in spec.symbols:
        facts = [
            f
            for d in x_new.shape
            if isinstance(d, torch.SymInt)
            for f in (_compat.symbol_facts(d) or {}).values()
            if f[0] == symbol.hint
        ]
        assert facts and facts[0] == (symbol.hint, symbol.lower, symbol.upper)
    # The graph's nodes carry fake values of the new shape env (what a general compile reads).
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = [a.meta["example_value"] for a in out.args[0]]
    assert values[0].shape[0].node.shape_env is x_new.shape[0].node.shape_env


def test_a_symbol_is_never_made_narrower_than_the_trace_had_it():
    gm = torch.fx.symbolic_trace(_plus_one)
    # A size the trace may see as 1 (its range starts at 0): made with that range, not >= 2.
    spec = SymbolicInputs((SymbolSpec("s0", 1, 0, None),), (SymbolicInt(_symbol("s0")),))
    (made,) = rebuild(spec, gm)
    assert _compat.symbol_facts(made) is not None
    assert list(_compat.symbol_facts(made).values()) == [(1, 0, None)]
    # An int argument (unbounded below) is not a size: refused, the parent compiles it.
    spec = SymbolicInputs((SymbolSpec("s0", 3, None, None),), (SymbolicInt(_symbol("s0")),))
    with pytest.raises(ValueError, match="cannot be made again"):
        rebuild(spec, gm)


def _plus_one(n: Any) -> Any:
    return n + 1


def _symbol(name: str) -> Any:
    import sympy

    return sympy.Symbol(name, integer=True, positive=True)


def test_inputs_that_cannot_cross_are_refused_and_compile_in_this_process(tmp_path):
    def aliased(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    base = torch.randn(4, 4)
    fakes = [mode.from_tensor(base), mode.from_tensor(base.t())]
    assert describe(fakes) is None  # two inputs of one storage: the compile plans for that
    assert describe([mode.from_tensor(torch.randn(4, 4)), mode.from_tensor(torch.randn(4, 4))]) is not None
    assert describe([mode.from_tensor(base[1:])]) is None  # a view at an offset
    assert describe([mode.from_tensor(torch.randn(2, dtype=torch.complex64).conj())]) is None
    # A symbol that is not a size's (an int argument's: not positive) is refused; a size's is not.
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    for positive, crosses in ((None, False), (True, True)):
        symbol = env.create_symbol(3, ConstantSource(f"n{positive}"), DimDynamic.DYNAMIC, positive=positive)
        assert (describe([env.create_symintnode(symbol, hint=3)]) is not None) is crosses
    assert describe([torch.randn(2).to_sparse()]) is None
    assert describe([object()]) is None
    compiler = InductorCompiler()
    compiler.initialize_cache(tmp_path)
    graph = torch.fx.symbolic_trace(aliased)
    assert compiler.job(graph, fakes, _config(), None, "piece") is None
    # A static size's inputs still cross as their layouts.
    job = compiler.job(graph, [torch.randn(6, 4), torch.randn(6, 4)], _config(), 6, "piece")
    assert job is not None and [t.shape for t in example_inputs(graph, job.inputs)] == [(6, 4), (6, 4)]


def _config() -> Any:
    import tessera

    return tessera.CompileConfig()
