"""``CompileConfig``: every knob of a tessera compile, validated once, hashed for the cache.

Fields that change compiled code enter ``compute_hash()``; paths and switches that do not, stay out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.errors import ConfigError

MODES = ("none", "stock", "trace_once", "piecewise")
BUILTIN_BACKENDS = ("inductor", "eager", "inductor_fx")
CUDAGRAPH_MODES = ("none", "piecewise", "full")

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


# What a piece is compiled for: None is the general (symbolic) size, an int one static size.
Size = int | SizeRange | None


def size_label(size: Size) -> str:
    """``general``, ``size 16`` or ``range [9,32]``: how records and logs name an artifact."""
    if size is None:
        return "general"
    if isinstance(size, SizeRange):
        return f"range {size}"
    return f"size {size}"


def _env(name: str) -> str | None:
    value = os.environ.get(f"TESSERA_{name}")
    return value if value not in (None, "") else None


def _env_bool(name: str) -> bool:
    value = _env(name)
    return value is not None and value.lower() in ("1", "true", "yes", "on")


def _env_ints(name: str) -> tuple[int, ...] | None:
    value = _env(name)
    if value is None:
        return None
    try:
        return tuple(int(part) for part in value.replace(" ", "").split(",") if part)
    except ValueError as e:
        raise ConfigError(f"TESSERA_{name}={value!r}: expected comma-separated integers") from e


def _env_default(name: str, default: Any, convert: Callable[[str], Any] = str) -> Any:
    def factory() -> Any:
        value = _env(name)
        if value is None:
            return default
        try:
            return convert(value)
        except ValueError as e:
            raise ConfigError(f"TESSERA_{name}={value!r} is not valid: {e}") from e

    return field(default_factory=factory)


@dataclass(frozen=True)
class CompileConfig:
    """How to compile one model. ``TESSERA_<FIELD>`` variables replace the built-in defaults."""

    mode: str = _env_default("MODE", "piecewise")
    backend: str = _env_default("BACKEND", "inductor")
    splitting_ops: Sequence[SplittingOp] | None = None
    compile_sizes: Sequence[int] = field(default_factory=lambda: _env_ints("COMPILE_SIZES") or ())
    compile_ranges: Sequence[int] = field(default_factory=lambda: _env_ints("COMPILE_RANGES") or ())
    max_size: int | None = _env_default("MAX_SIZE", None, int)
    cudagraph_mode: str = _env_default("CUDAGRAPH_MODE", "none")
    cudagraph_capture_sizes: Sequence[int] | None = field(
        default_factory=lambda: _env_ints("CUDAGRAPH_CAPTURE_SIZES")
    )
    cache_dir: str | None = _env_default("CACHE_DIR", None)
    disable_cache: bool = False
    inductor_config: Mapping[str, Any] = field(default_factory=dict)
    passes: Sequence[Any] = ()

    def __post_init__(self) -> None:
        # Normalise sequences to tuples so the frozen record cannot be mutated through a list.
        for name in ("compile_sizes", "compile_ranges", "passes"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.cudagraph_capture_sizes is not None:
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(self.cudagraph_capture_sizes))
        if self.splitting_ops is not None:
            object.__setattr__(self, "splitting_ops", tuple(self.splitting_ops))
        object.__setattr__(self, "inductor_config", dict(self.inductor_config))
        # The environment switch is an operator's kill switch: it wins over the config.
        object.__setattr__(self, "disable_cache", bool(self.disable_cache) or _env_bool("DISABLE_CACHE"))
        self._validate()

    def _validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is unknown; choose one of {MODES}")
        if self.backend not in BUILTIN_BACKENDS and ":" not in self.backend:
            raise ConfigError(
                f"backend={self.backend!r} is unknown; choose one of {BUILTIN_BACKENDS} "
                "or name your own compiler as 'package.module:ClassName'"
            )
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ConfigError(
                f"cudagraph_mode={self.cudagraph_mode!r} is unknown; choose one of {CUDAGRAPH_MODES}"
            )
        if self.max_size is not None and (not isinstance(self.max_size, int) or self.max_size < 1):
            raise ConfigError(f"max_size={self.max_size!r} must be a positive integer or None")
        _check_sizes("compile_sizes", self.compile_sizes, self.max_size, minimum=0)
        _check_sizes("compile_ranges", self.compile_ranges, self.max_size, minimum=1)
        if self.cudagraph_capture_sizes is not None:
            _check_sizes("cudagraph_capture_sizes", self.cudagraph_capture_sizes, self.max_size, 1)
        if self.cudagraph_mode != "none" and self.cudagraph_capture_sizes is not None:
            missing = [s for s in self.compile_sizes if s not in self.cudagraph_capture_sizes]
            if missing:
                raise ConfigError(
                    f"compile_sizes {missing} are not in cudagraph_capture_sizes: such calls would be "
                    "padded to a larger capture size and never use their static artifact; add them to "
                    "cudagraph_capture_sizes or drop them from compile_sizes"
                )
        if not isinstance(self.inductor_config, dict) or not all(
            isinstance(k, str) for k in self.inductor_config
        ):
            raise ConfigError("inductor_config must map Inductor config names (str) to values")

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
            "compile_sizes": list(self.compile_sizes),
            "compile_ranges": list(self.compile_ranges),
            "max_size": self.max_size,
            "cudagraph_mode": self.cudagraph_mode,
            "cudagraph_capture_sizes": None
            if self.cudagraph_capture_sizes is None
            else list(self.cudagraph_capture_sizes),
            "inductor_config": {k: repr(v) for k, v in sorted(self.inductor_config.items())},
            "passes": [_pass_uuid(p) for p in self.passes],
        }

    def compute_hash(self) -> str:
        """sha256 of ``hash_factors()``: equal configs give equal hashes in every process."""
        blob = json.dumps(self.hash_factors(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def _check_sizes(name: str, sizes: Sequence[int], max_size: int | None, minimum: int) -> None:
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool):
            raise ConfigError(f"{name} must hold integers; got {size!r}")
        if size < minimum:
            raise ConfigError(f"{name} must be >= {minimum}; got {size}")
        if max_size is not None and size > max_size:
            raise ConfigError(f"{name} entry {size} is above max_size={max_size}; raise max_size")
    if list(sizes) != sorted(set(sizes)):
        raise ConfigError(f"{name}={list(sizes)} must be sorted ascending without repeats")


def op_name(op: SplittingOp) -> str:
    """A stable, human-readable name for a splitting op spec (used in hashes and messages)."""
    import torch

    from tessera._compat import op_overload_name, packet_name

    if isinstance(op, str):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return packet_name(op)
    if isinstance(op, torch._ops.OpOverload):
        return op_overload_name(op)
    module = getattr(op, "__module__", None) or ""
    return f"{module}.{getattr(op, '__qualname__', getattr(op, '__name__', repr(op)))}"


def _pass_uuid(p: Any) -> str:
    uuid = getattr(p, "uuid", None)
    if not callable(uuid):
        raise ConfigError(f"pass {p!r} has no uuid() method; every pass must name its version")
    return str(uuid())
