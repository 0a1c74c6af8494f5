"""Piece runners: one compiled piece, its artifacts per size/range, and run-time dispatch.

A runner picks an artifact by the runtime size: exact compile size, then a range, then general.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tessera import counters
from tessera._compat import is_constant_symint, sym_expr, symbol_ranks
from tessera.compilation.piece_inputs import SavedInputs, device_memory
from tessera.config import TRACED_LABEL, Shape, Size, SizeRange, size_label
from tessera.errors import CompilerError, ConfigError, FallbackWarning, SizeNotCompiledError

if TYPE_CHECKING:
    from tessera.serving.learn import SizeTally  # set by serving, on a size's first call

log = logging.getLogger(__name__)

_MEMO_LIMIT = 4096  # distinct runtime sizes whose dispatch decision is remembered per piece


@dataclass(frozen=True)
class SizeSource:
    """Where a piece reads its runtime size: ``args[arg]``, or ``args[arg].shape[dim]``."""

    arg: int
    dim: int | None = None

    def read(self, args: Sequence[Any]) -> int:
        """The runtime size in ``args``."""
        value = args[self.arg]
        return value if self.dim is None else value.shape[self.dim]  # type: ignore[no-any-return]


@dataclass(frozen=True)
class DynamicInputs:
    """Which inputs and outputs of a piece follow the runtime size (what CUDA graphs must pad).

    ``tensor_dims[i]`` is the dim of input i that follows the size (None: fixed, e.g. a weight);
    ``output_dims`` the same for each output tensor.
    """

    tensor_dims: tuple[int | None, ...]
    symint_positions: tuple[int, ...]
    output_dims: tuple[int | None, ...]


def dynamic_inputs(example_inputs: Sequence[Any], example_outputs: Sequence[Any]) -> DynamicInputs:
    """From fake example values: the first symbolic dim of each tensor, and the SymInt inputs."""

    def dim_of(value: Any) -> int | None:
        if not isinstance(value, torch.Tensor):
            return None
        for dim, extent in enumerate(value.shape):
            if isinstance(extent, torch.SymInt) and not is_constant_symint(extent):
                return dim
        return None

    return DynamicInputs(
        tensor_dims=tuple(dim_of(v) for v in example_inputs),
        symint_positions=tuple(
            i
            for i, v in enumerate(example_inputs)
            if isinstance(v, torch.SymInt) and not is_constant_symint(v)
        ),
        output_dims=tuple(dim_of(v) for v in example_outputs),
    )


@dataclass(frozen=True)
class PieceRecord:
    """What tessera decided and did for one piece; ``compiled.pieces`` holds these."""

    name: str
    index: int
    is_splitting: bool
    sym_positions: tuple[int, ...] = ()
    returns_tuple: bool = False
    size_source: SizeSource | None = None
    sizes: tuple[int | Shape, ...] = ()  # its static sizes: listed, or read from listed shapes
    ranges: tuple[SizeRange, ...] = ()
    compile_seconds: tuple[tuple[str, float], ...] = ()
    served: tuple[tuple[str, int], ...] = ()
    dynamic: DynamicInputs | None = None
    cudagraph_sizes: tuple[int, ...] = ()
    partitions: int | None = None  # Inductor's own partitions of this piece (graph_partition mode)
    # Where each of the piece's dynamic sizes is read, in the order of a Shape's values, when it
    # has several (batch x length): what a learnt shape dispatches on. Empty: one size or none.
    shape_sources: tuple[SizeSource, ...] = ()
    # Its inputs as traced (auto sizes): what a process that loads the piece compiles a size it
    # learns from. None: not saved (a piece without a size, or auto sizes off).
    inputs: SavedInputs | None = None

    @property
    def artifacts(self) -> tuple[str, ...]:
        """Labels of the artifacts this piece holds (``general``, ``size 16``, ``range [1,8]``)."""
        return tuple(label for label, _ in self.compile_seconds)


# How Inductor's generated code starts the message of its input assert (torch 2.11-2.15:
# ``assert_size_stride``): "expected size 2==2, stride 16==112 at dim=1".
_INDUCTOR_INPUT_ASSERT = "expected size"


class _Artifact:
    __slots__ = ("as_traced", "fn", "holds", "label", "outside", "served")

    def __init__(self, fn: Callable[..., Any], label: str, as_traced: bool = False) -> None:
        self.fn = fn
        self.label = label
        self.served = 0
        self.as_traced = as_traced  # the piece as traced, serving until its artifact compiles
        # What the compile assumed of the inputs' sizes (inductor_compiler.GuardedCode), checked
        # before each call; None: nothing beyond the trace's own check.
        self.holds: Callable[[tuple[Any, ...]], bool] | None = getattr(fn, "holds", None)
        self.outside = 0  # calls its assumptions did not hold for, run as traced


class PieceRunner:
    """Calls the artifact that covers the runtime size; a size nothing covers is an error."""

    def __init__(
        self,
        name: str,
        artifacts: dict[Size, Callable[..., Any]],
        size_source: SizeSource | None,
        max_size: int | None,
        traced_general: bool = False,
        shape_sources: Sequence[SizeSource] = (),
    ) -> None:
        """``traced_general``: the general entry is the piece as traced (eager kernels), serving
        until its compiled artifact is added. ``shape_sources``: where each dynamic size is read,
        for a piece with several (its learnt shapes dispatch on them all)."""
        self.name = name
        self._shape_sources = tuple(shape_sources)
        self.max_size = max_size
        self._source = size_source
        self._artifacts = {size: _Artifact(fn, size_label(size)) for size, fn in artifacts.items()}
        if traced_general:
            self._artifacts[None] = _Artifact(artifacts[None], f"{size_label(None)} {TRACED_LABEL}", True)
        self._retired: tuple[_Artifact, ...] = ()  # replaced by an added artifact; kept for served()
        self._general = self._artifacts.get(None)
        self._ranges = sorted(
            ((s, a) for s, a in self._artifacts.items() if isinstance(s, SizeRange)),
            key=lambda item: item[0],
        )
        self._exact: dict[int, _Artifact] = {s: a for s, a in self._artifacts.items() if isinstance(s, int)}
        self._shapes: dict[tuple[int, ...], _Artifact] = {
            s.values: a for s, a in self._artifacts.items() if isinstance(s, Shape)
        }
        self._memo: dict[int, _Artifact] = dict(self._exact)
        self.tally: SizeTally | None = None  # the model's size counter, on its first sized piece
        # The piece as traced (its FX graph, eager kernels), where the process has it: what runs a
        # call whose inputs a compiled artifact refuses (see _as_traced). None when loaded.
        self.as_traced: Callable[..., Any] | None = None
        self._warned = False
        # Given one call's inputs, on a size's first call (a loaded piece that may learn a size
        # keeps its weights from them: size_learning.LoadedWork); None: nothing asks.
        self.keep_inputs: Callable[[tuple[Any, ...]], None] | None = None
        if size_source is None and self._general is None:
            raise ConfigError(f"piece {name} has no dynamic size, so it needs a general artifact")

    def __call__(self, *args: Any) -> Any:
        source = self._source
        if source is None:
            artifact = self._general
        elif self._shape_sources:
            artifact = self._by_shape(args)
        else:
            # SizeSource.read, inlined: this is the per-piece, per-call hot path.
            value = args[source.arg]
            size = value if source.dim is None else value.shape[source.dim]
            artifact = self._memo.get(size)
            if artifact is None:
                artifact = self._lookup(size)
                if self.keep_inputs is not None:
                    self._keep(args)
            if self.tally is not None:
                self.tally.seen(size, artifact.label)
        assert artifact is not None, f"{self.name}: no artifact chosen"
        holds = artifact.holds
        if holds is not None and not holds(args):
            return self._outside(artifact, args)
        artifact.served += 1
        try:
            return artifact.fn(*args)
        except AssertionError as e:
            if self.as_traced is None or not str(e).startswith(_INDUCTOR_INPUT_ASSERT):
                raise
            return self._as_traced(e, args, artifact.label)

    def _by_shape(self, args: tuple[Any, ...]) -> _Artifact:
        """A piece with several dynamic sizes: the artifact of its shape where one is learnt, else
        the one its first size chooses (a range, the general artifact); the shape is counted."""
        shape = tuple(s.read(args) for s in self._shape_sources)
        artifact = self._shapes.get(shape)
        if artifact is None:
            assert self._source is not None, "a piece with a shape has a size"
            size = self._source.read(args)
            artifact = self._memo.get(size) or self._lookup(size)
            if self.keep_inputs is not None:
                self._keep(args)
        if self.tally is not None:
            self.tally.seen(shape, artifact.label)
        return artifact

    def _keep(self, args: tuple[Any, ...]) -> None:
        """Hand one call's inputs to ``keep_inputs`` (once: it is then let go)."""
        keep, self.keep_inputs = self.keep_inputs, None
        if keep is not None:
            keep(args)

    def _outside(self, artifact: _Artifact, args: tuple[Any, ...]) -> Any:
        """A call whose sizes are outside what the chosen artifact's compile assumed (a size it
        fixed, a relation it relied on): the piece runs as traced, eager's kernels, for it."""
        if self.as_traced is None:
            raise CompilerError(
                f"piece {self.name} ({artifact.label}): this call's sizes are outside what its compile "
                "assumed, and the piece's graph is not at hand to run it as traced. Please report this"
            )
        if not artifact.outside:
            log.debug(
                "piece %s (%s): a call outside what its compile assumed runs as traced",
                self.name,
                artifact.label,
            )
        artifact.outside += 1
        counters.bump("outside_assumptions")
        return self.as_traced(*args)

    def _as_traced(self, error: AssertionError, args: tuple[Any, ...], label: str) -> Any:
        """A compiled artifact refused its inputs (Inductor's own size and stride assert, before
        any kernel ran): the piece runs as traced, eager's kernels on any layout, and says so once.
        A call's check should never let such inputs through: the warning is a bug to report."""
        assert self.as_traced is not None, "checked by the caller"
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"tessera: piece {self.name} ({label}) was handed inputs its compiled code was not made for "
                f"({str(error).splitlines()[0]}); it runs as traced (eager's kernels) for such calls. "
                "Results are correct; please report this",
                FallbackWarning,
                stacklevel=3,
            )
        counters.bump("artifact_fallbacks")
        return self.as_traced(*args)

    def add(self, size: Size, fn: Callable[..., Any]) -> None:
        """Swap in an artifact compiled after the first output (a background compile). Each
        structure the call path reads is replaced whole, never changed in place: a call in flight
        finishes on the artifact it chose, and every structure it may read is correct alone."""
        added = _Artifact(fn, size_label(size))
        if size in self._artifacts:
            self._retired = (*self._retired, self._artifacts[size])
        artifacts = {**self._artifacts, size: added}
        if isinstance(size, SizeRange):
            self._ranges = sorted(
                ((s, a) for s, a in artifacts.items() if isinstance(s, SizeRange)), key=lambda item: item[0]
            )
        elif isinstance(size, int):
            self._exact = {**self._exact, size: added}
        elif isinstance(size, Shape):
            self._shapes = {**self._shapes, size.values: added}
        else:  # the general artifact, compiled while the piece served as traced
            self._general = added
        self._artifacts = artifacts
        self._memo = dict(self._exact)  # sizes memoised on the general artifact look again

    def drop(self, size: int | Shape) -> None:
        """Take a static size's artifact out (a learnt size retired); its calls go to a range or
        the general artifact. Replaced whole, as in ``add``."""
        if isinstance(size, Shape):
            if size.values in self._shapes:
                self._retired = (*self._retired, self._artifacts[size])
                self._artifacts = {s: a for s, a in self._artifacts.items() if s != size}
                self._shapes = {s: a for s, a in self._shapes.items() if s != size.values}
            return
        if size not in self._exact:
            return
        self._retired = (*self._retired, self._artifacts[size])
        self._artifacts = {s: a for s, a in self._artifacts.items() if s != size}
        self._exact = {s: a for s, a in self._exact.items() if s != size}
        self._memo = dict(self._exact)

    @property
    def source(self) -> SizeSource | None:
        """Where the runtime size is read (None: the piece has no size)."""
        return self._source

    def sizes(self) -> tuple[int, ...]:
        """The static sizes this piece has an artifact for."""
        return tuple(sorted(self._exact))

    def _lookup(self, size: int) -> _Artifact:
        if size < 0 or (self.max_size is not None and size > self.max_size):
            raise SizeNotCompiledError(self._uncovered_message(size))
        # The memo read before the choice: if ``add`` replaces it meanwhile, this choice lands in
        # the old one (``add`` replaces the exact sizes first, the memo after).
        memo = self._memo
        artifact = self._exact.get(size) or next((a for r, a in self._ranges if size in r), self._general)
        if artifact is None:
            raise SizeNotCompiledError(self._uncovered_message(size))
        if len(memo) < _MEMO_LIMIT:
            memo[size] = artifact
        return artifact

    def _uncovered_message(self, size: int) -> str:
        labels = ", ".join(a.label for a in self._artifacts.values())
        return (
            f"piece {self.name}: runtime size {size} is not covered (max_size={self.max_size}); "
            f"compiled artifacts: {labels}. Raise max_size or add a compile size/range for it."
        )

    def artifact_for(self, size: int) -> str:
        """The label of the artifact that serves ``size`` (raises if none does)."""
        artifact = self._memo.get(size) or self._lookup(size)
        return artifact.label

    def served(self) -> tuple[tuple[str, int], ...]:
        """How many calls each artifact has served so far (label, calls)."""
        return tuple((a.label, a.served) for a in (*self._retired, *self._artifacts.values()))

    def guarded(self) -> bool:
        """Whether an artifact of this piece assumed more of the sizes than the trace checks: a
        process that loads it needs the piece's graph, to run the calls outside that as traced."""
        return any(a.holds is not None for a in self._artifacts.values())

    def served_as_traced(self) -> tuple[tuple[str, int], ...]:
        """The part of ``served`` the piece as traced served (while its general artifact compiled)."""
        return tuple((a.label, a.served) for a in (*self._retired, *self._artifacts.values()) if a.as_traced)


def find_size_source(example_inputs: Sequence[Any], symbol: Any = None) -> SizeSource | None:
    """Where the dynamic size itself can be read: the first SymInt argument that is a bare symbol,
    else the first tensor dim that is one; None if none is. A size derived from it (``2*s0``, a
    ``cat`` of two inputs) is never taken: dispatching on it would pick another size's artifact.
    ``symbol`` (sympy) restricts the search to that symbol."""

    def is_source(value: Any) -> bool:
        if not isinstance(value, torch.SymInt) or is_constant_symint(value):
            return False
        expr = sym_expr(value)
        return bool(expr.is_Symbol) and (symbol is None or expr == symbol)

    for i, value in enumerate(example_inputs):
        if is_source(value):
            return SizeSource(i)
    for i, value in enumerate(example_inputs):
        if isinstance(value, torch.Tensor):
            for dim, extent in enumerate(value.shape):
                if is_source(extent):
                    return SizeSource(i, dim)
    return None


def size_symbols(example_inputs: Sequence[Any]) -> list[Any]:
    """The inputs' shape symbols in the order Dynamo made them (the model's input dims, in order:
    batch before length), then by name: what a Shape's values are given for, and how its label
    reads (``shape 4x128``)."""
    ranks = symbol_ranks(example_inputs)
    return sorted(free_symbols(example_inputs), key=lambda s: (ranks.get(str(s), len(ranks)), str(s)))


def shape_sources(example_inputs: Sequence[Any]) -> tuple[SizeSource, ...]:
    """Where each shape symbol can be read, in ``size_symbols`` order, for inputs with several (a
    piece whose tensors vary in batch and length); empty for one or none, or where a symbol is
    only ever derived (``2*s0``) and cannot be read."""
    symbols = size_symbols(example_inputs)
    if len(symbols) < 2:
        return ()
    sources = [find_size_source(example_inputs, symbol) for symbol in symbols]
    return tuple(s for s in sources if s is not None) if all(sources) else ()


def free_symbols(example_inputs: Sequence[Any]) -> set[Any]:
    """Every shape symbol (sympy) in the inputs: SymInt values, tensor sizes and strides."""
    found: set[Any] = set()
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            found |= sym_expr(value).free_symbols
        elif isinstance(value, torch.Tensor):
            for extent in (*value.shape, *value.stride()):
                if isinstance(extent, torch.SymInt):
                    found |= sym_expr(extent).free_symbols
    return found


def specialize_inputs(
    piece: str,
    example_inputs: Sequence[Any],
    real_inputs: Sequence[Any | None],
    size: int | Shape,
) -> list[Any]:
    """Concrete inputs for compiling ``piece`` at one static ``size`` (or ``Shape``: a value for
    each of its dynamic sizes, in ``size_symbols`` order).

    Inputs without symbolic shapes reuse the real tensor Dynamo saw (weights: no copy); the others
    become zero tensors with the size substituted into every symbolic dim and stride.
    """
    symbols = size_symbols(example_inputs)
    if isinstance(size, Shape):
        if len(symbols) != len(size.values):
            raise ConfigError(f"piece {piece}: shape {size} is not one value for each of {symbols}")
        values = dict(zip(symbols, size.values, strict=True))
    elif len(symbols) != 1:
        raise ConfigError(
            f"piece {piece}: compile_sizes need exactly one dynamic size, found symbols "
            f"{sorted(map(str, symbols))}; mark a single dynamic dim with dynamic_dims=..."
        )
    else:
        values = {symbols[0]: size}

    def concrete(extent: Any) -> int:
        if isinstance(extent, torch.SymInt):
            return int(sym_expr(extent).subs(values))
        return int(extent)

    _check_fits(piece, size, [fake for fake in example_inputs if isinstance(fake, torch.Tensor)], concrete)
    out: list[Any] = []
    for fake, real in zip(example_inputs, real_inputs, strict=True):
        if isinstance(fake, torch.SymInt):
            out.append(concrete(fake))
        elif isinstance(fake, torch.Tensor):
            dims = (*fake.shape, *fake.stride())
            if real is not None and not any(isinstance(d, torch.SymInt) for d in dims):
                out.append(real)
                continue
            shape = [concrete(d) for d in fake.shape]
            stride = [concrete(d) for d in fake.stride()]
            tensor = torch.empty_strided(shape, stride, dtype=fake.dtype, device=fake.device)
            out.append(tensor.zero_())
        else:
            out.append(fake)
    return out


def _check_fits(
    piece: str, size: int | Shape, fakes: list[torch.Tensor], concrete: Callable[[Any], int]
) -> None:
    """ConfigError if the example inputs for ``size`` would not fit in their device's memory."""
    needed: dict[torch.device, int] = {}
    for fake in fakes:
        if not any(isinstance(d, torch.SymInt) for d in (*fake.shape, *fake.stride())):
            continue  # the real tensor is reused
        extent = 1 + sum(
            (concrete(n) - 1) * concrete(s) for n, s in zip(fake.shape, fake.stride(), strict=True)
        )
        if any(concrete(n) == 0 for n in fake.shape):
            extent = 0
        needed[fake.device] = needed.get(fake.device, 0) + extent * fake.element_size()
    for device, nbytes in needed.items():
        available = device_memory(device)
        if available is not None and nbytes > available:
            raise ConfigError(
                f"piece {piece}: compile size {size} needs {nbytes / 2**30:.1f} GiB of example inputs "
                f"on {device}, which has {available / 2**30:.1f} GiB: drop {size} from compile_sizes"
            )
