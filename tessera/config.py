"""``CompileConfig``: every knob of a tessera compile, validated once, hashed for the cache.

Fields that change compiled code enter ``hash_factors()`` (hashed by ``cache.key.config_record``);
paths and switches that do not, stay out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera import validation as v
from tessera.errors import ConfigError

MODES = ("none", "stock", "trace_once", "piecewise")
PRIORITIES = ("low", "idle", "normal")  # CompileConfig.background_priority (compilation/priority.py)
# Sizes learnt from traffic (compilation="auto", serving/learn.py): a size's share of recent calls
# to be learnt, and how many a trace learns by default (CompileConfig.auto_sizes).
DEFAULT_SHARE = 0.05
DEFAULT_LIMIT = 8
# A call's size as it is counted and learnt: one value, or one per dynamic size of pieces that have
# several (batch x length: a shape, compiled as config.Shape).
Counted = int | tuple[int, ...]
BUILTIN_BACKENDS = ("inductor", "eager")
# Backends tessera once named and no longer serves, with what to use instead.
RETIRED_BACKENDS = {
    "inductor_fx": "served torch < 2.8 through Inductor's FX graph cache; tessera needs torch >= 2.11, "
    "where standalone compile does the same job through a public API: use backend='inductor'",
}
CUDAGRAPH_MODES = ("none", "piecewise", "full")
DYNAMIC_SHAPES = ("backed", "unbacked", "backed_size_oblivious")

# A splitting op spec: "ns::op", "ns::op.overload", a dotted Python path, an OpOverload(Packet)
# or any Python callable that shows up as a call_function target in a Dynamo graph.
SplittingOp = Any


@dataclass(frozen=True, order=True)
class SizeRange:
    """An inclusive range of runtime sizes ``[start, end]``; ``end=None`` means no upper bound."""

    start: int
    end: int | None

    def __contains__(self, size: object) -> bool:
        return isinstance(size, int) and self.start <= size and (self.end is None or size <= self.end)

    def __str__(self) -> str:
        return f"[{self.start},{'max' if self.end is None else self.end}]"


@dataclass(frozen=True, order=True)
class Shape:
    """One static value for each dynamic size of a piece that has several (batch x length), in the
    order of the piece's size symbols (``piece.shape_sources``): a shape learnt from traffic."""

    values: tuple[int, ...]

    def __str__(self) -> str:
        return "x".join(map(str, self.values))


# What a piece is compiled for: None is the general (symbolic) size, an int one static size, a
# Shape one static value per dynamic size.
Size = int | SizeRange | Shape | None


def static_size(counted: Counted) -> int | Shape:
    """What a counted size compiles as: itself, or the Shape of its values."""
    return Shape(counted) if isinstance(counted, tuple) else counted


def counted_of(value: Any) -> Counted | None:
    """A size as a record holds it (a positive int, or a list of two or more: a shape), read back;
    None when it is neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 1 else None
    if (
        isinstance(value, list | tuple)
        and len(value) >= 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    ):
        return tuple(value)
    return None


# Appended to a general entry that is the piece as traced (eager kernels), serving until its
# compiled artifact is ready (CompileConfig.serve_while_compiling).
TRACED_LABEL = "(as traced)"
DEFAULT_MAX_TRACES = 16  # traces a model holds when max_traces is not given (then not strict)


def size_label(size: Size) -> str:
    """``general``, ``size 16``, ``range [9,32]`` or ``shape 4x128``: how records and logs name an
    artifact."""
    if size is None:
        return "general"
    if isinstance(size, SizeRange):
        return f"range {size}"
    if isinstance(size, Shape):
        return f"shape {size}"
    return f"size {size}"


@dataclass(frozen=True)
class CompileConfig:
    """How to compile one model. ``TESSERA_<FIELD>`` variables replace the built-in defaults.

    Every field is checked on construction (see validation.py): a bad value is a ``ConfigError``
    naming the field, the value and what is accepted.
    """

    mode: str = field(
        default_factory=lambda: v.env_value(
            "MODE", "piecewise", check=lambda m: v.check_choice("mode", m, MODES)
        )
    )
    backend: str = field(
        default_factory=lambda: v.env_value(
            "BACKEND", "inductor", check=lambda b: v.check_backend(b, BUILTIN_BACKENDS, RETIRED_BACKENDS)
        )
    )
    splitting_ops: Sequence[SplittingOp] | None = None
    # Static sizes to compile: a list, "auto" (learnt from traffic, see auto_sizes), or a list
    # holding "auto" (those sizes, and others learnt). An entry is an integer (the one dynamic
    # size) or a shape: a tuple, one value for each dim of the model's input that varies, in order
    # ((4, 128): input_ids of batch 4, length 128; listed_shapes.py). Normalised to the listed
    # integers, then the shapes.
    compile_sizes: Sequence[int | str | tuple[int, ...]] | str = field(
        default_factory=lambda: v.env_sizes("COMPILE_SIZES")
    )
    compile_ranges: Sequence[int] = field(default_factory=lambda: v.env_ints("COMPILE_RANGES") or ())
    max_size: int | None = field(
        default_factory=lambda: v.env_value("MAX_SIZE", None, int, check=v.check_max_size)
    )
    cudagraph_mode: str = field(
        default_factory=lambda: v.env_value(
            "CUDAGRAPH_MODE", "none", check=lambda m: v.check_choice("cudagraph_mode", m, CUDAGRAPH_MODES)
        )
    )
    cudagraph_capture_sizes: Sequence[int] | None = field(
        default_factory=lambda: v.env_ints("CUDAGRAPH_CAPTURE_SIZES")
    )
    cache_dir: str | None = field(default_factory=lambda: v.env_value("CACHE_DIR", None))
    disable_cache: bool = False
    inductor_config: Mapping[str, Any] = field(default_factory=dict)
    passes: Sequence[Any] = ()
    check_inputs: bool = True  # compare every call with what the trace assumed (see call_check.py)
    # Traces one model may hold (traces.py): a call no trace covers is traced again, as Dynamo
    # recompiles, up to DEFAULT_MAX_TRACES (16) of them; past that the call is served eagerly,
    # with one warning naming what changed (as stock torch.compile runs eager past its recompile
    # limit). Given explicitly (here or TESSERA_MAX_TRACES), it is strict: past it a call is
    # refused naming every trace and why it was made. 1: trace once and refuse any call unlike
    # the first. 16, not Dynamo's 8: traces converge (a size that changed is dynamic from then
    # on), so they count the kinds of call, and a generate() loop has more than 8 (prefill and
    # decode, with and without a mask, sizes of 1 traced apart).
    max_traces: int | None = field(
        default_factory=lambda: v.env_value("MAX_TRACES", None, int, v.check_max_traces)
    )
    # Sizes learnt from traffic (learn.py): a size that holds auto_sizes_share of recent calls is
    # compiled statically in the background and swapped in, at most auto_sizes of them per trace
    # (the coldest retired for a hotter one), and the next process loads them at once. 0: none;
    # compile_sizes="auto" sets it to 8 when it is 0.
    auto_sizes: int = field(default_factory=lambda: v.env_value("AUTO_SIZES", 0, int, v.check_auto_sizes))
    auto_sizes_share: float = field(
        default_factory=lambda: v.env_value("AUTO_SIZES_SHARE", DEFAULT_SHARE, float, v.check_share)
    )
    dynamic_shapes: str = field(
        default_factory=lambda: v.env_value(
            "DYNAMIC_SHAPES", "backed", check=lambda m: v.check_choice("dynamic_shapes", m, DYNAMIC_SHAPES)
        )
    )
    graph_partition: bool = False  # one graph to Inductor, partitioned by Inductor (torch >= 2.9)
    # A model Dynamo cannot trace as one graph (graph breaks): False runs it as torch.compile
    # would, each graph compiled and cached by tessera, Dynamo's guards kept (warned once);
    # True refuses it with UnsupportedModelError.
    fullgraph: bool = False
    # Serve first, specialise after: the first output waits for each piece's general artifact
    # only; compile sizes and ranges compile in a background thread and are swapped in when
    # ready. False compiles everything before the first output (tests, batch jobs).
    background_compile: bool = field(default_factory=lambda: not v.env_off("BACKGROUND_COMPILE"))
    # With background_compile: the first output waits for the trace alone. Each piece runs as
    # traced (the same ATen kernels as eager) until its general artifact, compiled first in the
    # background, is swapped in. False: the first output waits for each distinct piece's general
    # compile. A first call of a listed size under 2 (a size-1 decode) is always compiled at once.
    serve_while_compiling: bool = True
    # With background_compile: a call no trace covers (the first of a cold process) is answered by
    # the model's own forward while its trace is made in another thread (beside.py), so no call
    # waits for a trace. Off by default: that thread shares the process with the user's code (its
    # trace undoes the global RNG draws made meanwhile, and imports Dynamo beside the user's
    # imports, docs/process.md). False: a call no trace covers is traced in the caller's thread.
    eager_first: bool = field(default_factory=lambda: v.env_on("EAGER_FIRST"))
    # With background_compile: whether the process's exit waits for the background compiles (the
    # next process then starts warm: nothing traced, nothing compiled); Ctrl-C ends the wait.
    # False (the default): the exit stops them at once, keeping in the cache what was compiled;
    # the next process traces again and compiles what is missing. A script that fills a cache
    # for others sets it, or calls wait_ready() before it ends.
    finish_at_exit: bool = field(default_factory=lambda: v.env_on("FINISH_AT_EXIT"))
    # The CPU priority of the compile worker processes (priority.py): "low" (nice 19), "idle"
    # (Linux SCHED_IDLE) or "normal". This process's own threads keep the caller's priority.
    background_priority: str = field(
        default_factory=lambda: v.env_value(
            "BACKGROUND_PRIORITY", "low", str, lambda x: v.check_choice("background_priority", x, PRIORITIES)
        )
    )
    # Worker processes that compile the static sizes (compile_sizes), and in the background the
    # general artifacts, off this process's GIL; started on the first model that needs them and
    # kept for the process; artifacts are the same as compiled here. 0: none. None: one per two
    # cores beyond two, up to 8, and at least one where general artifacts compile in the
    # background while pieces serve as traced (compile_pool.default_count).
    compile_workers: int | None = field(
        default_factory=lambda: v.env_value("COMPILE_WORKERS", None, int, v.check_workers)
    )
    debug_dump_dir: str | None = field(default_factory=lambda: v.env_value("DEBUG_DUMP", None))
    cache_remote: str | None = field(default_factory=lambda: v.env_value("CACHE_REMOTE", None))
    # With an object store as cache_remote: a Redis URL that holds the leases instead of the store
    # (the store's conditional writes hold them when None).
    cache_remote_leases: str | None = field(default_factory=lambda: v.env_value("CACHE_REMOTE_LEASES", None))

    def __post_init__(self) -> None:
        # Checked, then normalised to tuples so the frozen record cannot be mutated through a list.
        v.check_choice("mode", self.mode, MODES)
        v.check_backend(self.backend, BUILTIN_BACKENDS, RETIRED_BACKENDS)
        v.check_choice("cudagraph_mode", self.cudagraph_mode, CUDAGRAPH_MODES)
        v.check_max_size(self.max_size)
        v.check_bool("disable_cache", self.disable_cache)
        v.check_bool("check_inputs", self.check_inputs)
        v.check_choice("dynamic_shapes", self.dynamic_shapes, DYNAMIC_SHAPES)
        v.check_bool("graph_partition", self.graph_partition)
        v.check_bool("fullgraph", self.fullgraph)
        v.check_bool("background_compile", self.background_compile)
        v.check_bool("eager_first", self.eager_first)
        v.check_bool("finish_at_exit", self.finish_at_exit)
        v.check_choice("background_priority", self.background_priority, PRIORITIES)
        v.check_bool("serve_while_compiling", self.serve_while_compiling)
        v.check_workers(self.compile_workers)
        if self.max_traces is not None:
            v.check_max_traces(self.max_traces)
        v.check_auto_sizes(self.auto_sizes)
        v.check_share(self.auto_sizes_share)
        listed, auto = v.split_auto(self.compile_sizes)
        fields = {
            "splitting_ops": v.check_splitting_ops(self.splitting_ops),
            "compile_sizes": v.check_compile_sizes(listed, self.max_size),
            "auto_sizes": DEFAULT_LIMIT if auto and not self.auto_sizes else self.auto_sizes,
            "compile_ranges": v.check_sizes("compile_ranges", self.compile_ranges, self.max_size, 1),
            "cudagraph_capture_sizes": None
            if self.cudagraph_capture_sizes is None
            else v.check_sizes("cudagraph_capture_sizes", self.cudagraph_capture_sizes, self.max_size, 1),
            "cache_dir": v.check_cache_dir(self.cache_dir),
            "debug_dump_dir": v.check_cache_dir(self.debug_dump_dir, "debug_dump_dir"),
            "cache_remote": v.check_remote(self.cache_remote),
            "cache_remote_leases": v.check_remote_leases(self.cache_remote_leases, self.cache_remote),
            "inductor_config": v.check_inductor_config(self.inductor_config),
            "passes": v.check_passes(self.passes),
            # The environment switch is an operator's kill switch: it wins over the config.
            "disable_cache": self.disable_cache or v.env_bool("DISABLE_CACHE"),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        if self.cudagraph_mode != "none" and self.cudagraph_capture_sizes is not None:
            missing = [s for s in self.sizes if s not in self.cudagraph_capture_sizes]
            if missing:
                raise ConfigError(
                    f"compile_sizes {missing} are not in cudagraph_capture_sizes: such calls would be "
                    "padded to a larger capture size and never use their static artifact; add them to "
                    "cudagraph_capture_sizes or drop them from compile_sizes"
                )
        if self.graph_partition and (self.backend != "inductor" or self.mode != "piecewise"):
            raise ConfigError(
                f"graph_partition=True lets Inductor partition the graph around the splitting ops: it "
                f"needs backend='inductor' and mode='piecewise' (got backend={self.backend!r}, "
                f"mode={self.mode!r})"
            )
        if self.graph_partition and self.cudagraph_mode == "piecewise":
            # The one partitioned piece would be captured whole, attention and padding included.
            raise ConfigError(
                "graph_partition=True with cudagraph_mode='piecewise' would capture the whole graph, "
                "attention included, like cudagraph_mode='full'; use graph_partition=False for "
                "piecewise CUDA graphs, or cudagraph_mode='full' or 'none'"
            )

    @property
    def trace_limit(self) -> int:
        """The traces one model may hold (``max_traces``, or DEFAULT_MAX_TRACES)."""
        return DEFAULT_MAX_TRACES if self.max_traces is None else self.max_traces

    @property
    def strict_traces(self) -> bool:
        """Whether a call past the trace limit is refused (``max_traces`` given, or ``fullgraph``)
        rather than served eagerly."""
        return self.max_traces is not None or self.fullgraph

    @property
    def sizes(self) -> tuple[int, ...]:
        """The listed compile sizes, integers (``"auto"`` is ``auto_sizes``; shapes: ``shapes``)."""
        return tuple(s for s in self.compile_sizes if isinstance(s, int))

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The listed shapes: one value for each dim of the model's input that varies."""
        return tuple(tuple(s) for s in self.compile_sizes if isinstance(s, tuple | list))

    @property
    def ranges(self) -> tuple[SizeRange, ...]:
        """The size ranges the endpoints describe: ``[8, 32]`` → ``[1,8] [9,32] [33,max_size]``."""
        out: list[SizeRange] = []
        start = 1
        for end in self.compile_ranges:
            out.append(SizeRange(start, end))
            start = end + 1
        if out and (self.max_size is None or start <= self.max_size):
            out.append(SizeRange(start, self.max_size))
        return tuple(out)

    def replace(self, **changes: Any) -> CompileConfig:
        """A copy with ``changes`` applied (validated); unknown field names are a ``ConfigError``."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"unknown CompileConfig field(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **changes)

    def hash_factors(self) -> dict[str, Any]:
        """The fields that change compiled code, as JSON-ready values."""
        return {
            "mode": self.mode,
            "backend": self.backend,
            "splitting_ops": None
            if self.splitting_ops is None
            else [op_name(op) for op in self.splitting_ops],
            "compile_sizes": [list(s) if isinstance(s, tuple) else s for s in self.compile_sizes],
            "compile_ranges": list(self.compile_ranges),
            "max_size": self.max_size,
            "cudagraph_mode": self.cudagraph_mode,
            "cudagraph_capture_sizes": None
            if self.cudagraph_capture_sizes is None
            else list(self.cudagraph_capture_sizes),
            "inductor_config": {k: repr(v) for k, v in sorted(self.inductor_config.items())},
            "passes": [_pass_uuid(p) for p in self.passes],
            "dynamic_shapes": self.dynamic_shapes,
            "graph_partition": self.graph_partition,
        }


def op_name(op: SplittingOp) -> str:
    """A stable, human-readable name for a splitting op spec (used in hashes and messages)."""
    from tessera import _compat
    from tessera._compat import op_overload_name, packet_name

    if isinstance(op, str):
        return op
    if isinstance(op, _compat.OpOverloadPacket):
        return packet_name(op)
    if isinstance(op, _compat.OpOverload):
        return op_overload_name(op)
    module = getattr(op, "__module__", None) or ""
    return f"{module}.{getattr(op, '__qualname__', getattr(op, '__name__', repr(op)))}"


def _pass_uuid(p: Any) -> str:
    uuid = getattr(p, "uuid", None)
    if not callable(uuid):
        raise ConfigError(f"pass {p!r} has no uuid() method; every pass must name its version")
    return str(uuid())


def checked_config(
    config: CompileConfig | None, overrides: dict[str, Any], prefix: Any, dynamic_dims: Any, on_compiled: Any
) -> CompileConfig:
    """``tessera.compile``'s arguments checked, and the config they make: a bad one is a
    ConfigError now, not at the first call."""
    if on_compiled is not None and not callable(on_compiled):
        raise ConfigError(f"on_compiled={on_compiled!r} must be a callable taking the compile report")
    if config is not None and not isinstance(config, CompileConfig):
        raise ConfigError(f"config={config!r} must be a tessera.CompileConfig (or None)")
    config = (config or CompileConfig()).replace(**overrides)
    if prefix is not None:
        v.check_prefix(prefix)
    v.check_dynamic_dims(dynamic_dims)
    if config.passes and config.backend == "eager":
        raise ConfigError(
            "passes run on Inductor's post-grad graph: use backend='inductor' (the eager compiler "
            "compiles nothing), or a custom compiler that applies config.passes itself"
        )
    if config.backend == "inductor" or config.mode == "stock":
        v.check_inductor_keys(config.inductor_config)
    return config


def by_size(row: tuple[Counted, str, int]) -> tuple[tuple[int, ...], str]:
    """The order of a histogram's rows: by size (a shape by its values), then label."""
    size = row[0]
    return (size if isinstance(size, tuple) else (size,), row[1])
