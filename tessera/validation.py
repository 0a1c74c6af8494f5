"""Checks of every ``CompileConfig`` field and ``TESSERA_*`` variable, done once, up front.

Each message names the field (or variable), the value given and what is accepted.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tessera.errors import ConfigError

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")


def env(name: str) -> str | None:
    """``TESSERA_<name>``, or None when unset or empty."""
    value = os.environ.get(f"TESSERA_{name}")
    return value if value not in (None, "") else None


def env_off(name: str) -> bool:
    """Whether ``TESSERA_<name>`` turns a default-on switch off (unset: on)."""
    value = os.environ.get(f"TESSERA_{name}", "").strip()
    return value != "" and not env_bool(name)


def env_on(name: str) -> bool:
    """Whether ``TESSERA_<name>`` turns a default-off switch on (unset: off)."""
    value = os.environ.get(f"TESSERA_{name}", "").strip()
    return value != "" and env_bool(name)


def env_bool(name: str) -> bool:
    value = os.environ.get(f"TESSERA_{name}", "").strip().lower()
    if value in TRUE_WORDS:
        return True
    if value in FALSE_WORDS:
        return False
    raise ConfigError(
        f"TESSERA_{name}={os.environ[f'TESSERA_{name}']!r}: expected one of 1/true/yes/on or 0/false/no/off"
    )


def env_ints(name: str) -> tuple[int, ...] | None:
    value = env(name)
    if value is None:
        return None
    try:
        return tuple(int(part) for part in value.replace(" ", "").split(",") if part)
    except ValueError as e:
        raise ConfigError(
            f"TESSERA_{name}={value!r}: expected comma-separated integers such as 1,8,16"
        ) from e


def env_sizes(name: str) -> tuple[int | str | tuple[int, ...], ...]:
    """``TESSERA_<name>``: comma-separated sizes, each an integer, a shape (``4x128``) or ``auto``."""
    value = env(name)
    if value is None:
        return ()
    parts = [part for part in value.replace(" ", "").split(",") if part]
    try:
        return tuple(_env_size(part) for part in parts)
    except ValueError as e:
        raise ConfigError(
            f"TESSERA_{name}={value!r}: expected comma-separated integers such as 1,8,16, shapes such "
            "as 4x128 (batch x length), or auto, or a mix (1,4x128,auto)"
        ) from e


def _env_size(part: str) -> int | str | tuple[int, ...]:
    if part == AUTO:
        return part
    if "x" in part:
        return tuple(int(v) for v in part.split("x"))
    return int(part)


AUTO = "auto"


def split_auto(sizes: Any) -> tuple[Any, bool]:
    """``compile_sizes`` as given: the listed sizes, and whether ``"auto"`` was among them."""
    if sizes == AUTO:
        return (), True
    if isinstance(sizes, Sequence) and not isinstance(sizes, (str, bytes)) and AUTO in sizes:
        return tuple(s for s in sizes if s != AUTO), True
    return sizes, False


def check_auto_sizes(value: Any) -> None:
    if not is_int(value) or value < 0 or value > 64:
        raise ConfigError(
            f"auto_sizes={value!r} must be an integer from 0 (learn no size) to 64: each size "
            "learnt costs one static compile of every piece"
        )


def check_share(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(
            f"auto_sizes_share={value!r} must be a fraction in (0, 1]: the share of recent calls a "
            "size needs before it is compiled statically (0.05 by default)"
        )


def env_value(
    name: str, default: Any, convert: Callable[[str], Any] = str, check: Callable[[Any], Any] | None = None
) -> Any:
    """``TESSERA_<name>`` converted and checked, or ``default``; errors name the variable."""
    value = env(name)
    if value is None:
        return default
    try:
        converted = convert(value)
        if check is not None:
            check(converted)
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"TESSERA_{name}={value!r} is not valid: {e}") from e
    return converted


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_choice(field: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{field}={value!r} is unknown; choose one of {tuple(choices)}")


def check_bool(field: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{field}={value!r} must be True or False (a {type(value).__name__} was given)")


# The largest size a compile size, range or capture size may name: 2**31 elements along one dim
# of even a 1-byte tensor is 2 GiB per unit of every other dim.
MAX_COMPILE_SIZE = 2**31 - 1


def check_sizes(field: str, sizes: Any, max_size: int | None, minimum: int) -> tuple[int, ...]:
    """A sorted, repeat-free sequence of integers >= ``minimum`` (and <= ``max_size``)."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise ConfigError(
            f"{field}={sizes!r} must be a list of integers such as [1, 8, 16] "
            f"(a {type(sizes).__name__} was given)"
        )
    for size in sizes:
        if not is_int(size):
            raise ConfigError(f"{field} must hold integers; got {size!r} in {list(sizes)}")
        if size < minimum:
            raise ConfigError(f"{field} must be >= {minimum}; got {size}")
        if size > MAX_COMPILE_SIZE:
            raise ConfigError(
                f"{field} entry {size} is above {MAX_COMPILE_SIZE}: no tensor of that size fits in "
                "memory; use the sizes calls really have"
            )
        if max_size is not None and size > max_size:
            raise ConfigError(f"{field} entry {size} is above max_size={max_size}; raise max_size")
    if list(sizes) != sorted(set(sizes)):
        raise ConfigError(f"{field}={list(sizes)} must be sorted ascending without repeats")
    return tuple(sizes)


def check_compile_sizes(listed: Any, max_size: int | None) -> tuple[int | tuple[int, ...], ...]:
    """``compile_sizes`` without ``"auto"``: the integers (sorted, see ``check_sizes``), then the
    shapes (tuples of two or more integers >= 1: one value per dynamic size), sorted."""
    if isinstance(listed, (str, bytes)) or not isinstance(listed, Sequence):
        raise ConfigError(
            f"compile_sizes={listed!r} must be a list of integers such as [1, 8, 16], of shapes such "
            f"as [(4, 128)], or 'auto' (a {type(listed).__name__} was given)"
        )
    shapes = [s for s in listed if isinstance(s, (tuple, list))]
    sizes = check_sizes("compile_sizes", [s for s in listed if not isinstance(s, (tuple, list))], max_size, 1)
    checked = []
    for shape in shapes:
        if len(shape) < 2 or not all(is_int(d) and 1 <= d <= MAX_COMPILE_SIZE for d in shape):
            raise ConfigError(
                f"compile_sizes shape {shape!r} must hold two or more integers >= 1, one for each "
                "dim of the model's input that varies, in order, e.g. (4, 128) for input_ids of "
                "batch 4 and length 128"
            )
        checked.append(tuple(shape))
    if len(set(checked)) != len(checked):
        raise ConfigError(f"compile_sizes lists a shape twice: {checked}")
    return (*sizes, *sorted(checked))


def check_workers(value: Any) -> None:
    if value is not None and (not is_int(value) or value < 0):
        raise ConfigError(
            f"compile_workers={value!r} must be a number of processes >= 0 (0: compile in this "
            "process only) or None (chosen from the number of cores)"
        )


def check_max_traces(value: Any) -> None:
    if not is_int(value) or value < 1:
        raise ConfigError(
            f"max_traces={value!r} must be a positive integer (1: trace once, refuse calls unlike "
            "the first; not given: up to 16, then calls no trace covers are served eagerly)"
        )


def check_max_size(value: Any) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise ConfigError(f"max_size={value!r} must be a positive integer or None")


def check_backend(value: Any, builtin: Sequence[str], retired: Mapping[str, str]) -> None:
    if isinstance(value, str) and value in retired:
        raise ConfigError(f"backend={value!r} {retired[value]}")
    if not isinstance(value, str) or (value not in builtin and ":" not in value):
        raise ConfigError(
            f"backend={value!r} is unknown; choose one of {tuple(builtin)} "
            "or name your own compiler as 'package.module:ClassName'"
        )


def check_splitting_ops(value: Any) -> tuple[Any, ...] | None:
    """None (the default attention ops), or a list of op names, ops or callables."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(
            f"splitting_ops={value!r} must be a list (e.g. [{value!r}] or [torch.ops.ns.op]), "
            f"or None for the default attention ops"
        )
    for spec in value:
        if isinstance(spec, str):
            if "::" not in spec and "." not in spec:
                raise ConfigError(
                    f"splitting op {spec!r}: expected 'ns::op', 'ns::op.overload' or a dotted path "
                    "such as 'torch.nn.functional.scaled_dot_product_attention'"
                )
        elif not callable(spec):
            raise ConfigError(f"splitting op {spec!r} is not an op name, an op or a callable")
    return tuple(value)


def check_inductor_config(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"inductor_config={value!r} must map Inductor config names to values, "
            "e.g. {'max_autotune': False}"
        )
    return dict(value)


def check_inductor_keys(value: Mapping[str, Any]) -> None:
    """Every key names an Inductor setting (imports Inductor's config, so only when there are keys)."""
    if not value:
        return
    from tessera import _compat

    known = _compat.inductor_config_names()
    unknown = sorted(k for k in value if k not in known)
    if unknown:
        raise ConfigError(
            f"inductor_config has unknown Inductor setting(s) {unknown}; see torch._inductor.config "
            "(e.g. 'max_autotune', 'cpp.simdlen')"
        )


def check_passes(value: Any) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"passes={value!r} must be a list of pass objects")
    for p in value:
        if not callable(p) or not callable(getattr(p, "uuid", None)):
            raise ConfigError(f"pass {p!r} must be callable and have a uuid() method naming its version")
    return tuple(value)


def check_cache_dir(value: Any, field: str = "cache_dir") -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(f"{field}={value!r} must be a directory path or None")
    return os.fspath(value)


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
OBJECT_STORE_SCHEMES = ("s3://", "gs://", "file://")


def check_remote(value: Any) -> str | None:
    """A Redis URL (``redis://host:port/db``, ``rediss://``, ``unix://``), an object store's
    (``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///shared/dir``), or None."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(REDIS_SCHEMES + OBJECT_STORE_SCHEMES):
        raise ConfigError(
            f"cache_remote={value!r} must be a Redis URL such as 'redis://127.0.0.1:6379/0' or an object "
            "store's such as 's3://bucket/prefix', 'gs://bucket/prefix' or 'file:///shared/dir'"
        )
    scheme, rest = value.split("://", 1)
    if value.startswith(OBJECT_STORE_SCHEMES) and not (
        rest.startswith("/") if scheme == "file" else rest.strip("/")
    ):
        raise ConfigError(f"cache_remote={value!r} names no bucket (or, for file://, no absolute path)")
    return value


def check_remote_leases(value: Any, remote: str | None) -> str | None:
    """A Redis URL for the leases of an object-store tier, or None."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(REDIS_SCHEMES):
        raise ConfigError(f"cache_remote_leases={value!r} must be a Redis URL such as 'redis://host:6379/0'")
    if remote is None or not remote.startswith(OBJECT_STORE_SCHEMES):
        raise ConfigError(
            "cache_remote_leases holds the leases of an object-store tier: set cache_remote to an "
            f"s3://, gs:// or file:// URL (it is {remote!r}), or drop cache_remote_leases"
        )
    return value


def env_seconds(name: str, default: float) -> float:
    """``TESSERA_<name>`` as a number of seconds > 0, or ``default``."""

    def positive(seconds: float) -> None:
        if not seconds > 0:
            raise ValueError("expected a number of seconds > 0")

    return float(env_value(name, default, float, positive))


@functools.cache
def warn_if_untested_torch() -> None:
    """Once per process: a torch outside the tested range installs and runs, with a warning."""
    import warnings

    from tessera import _compat
    from tessera.errors import UntestedTorchWarning

    reason = _compat.untested_torch()
    if reason is not None:
        warnings.warn(reason, UntestedTorchWarning, stacklevel=3)


def check_prefix(prefix: Any, field: str = "prefix", example: str = "backbone") -> None:
    """A cache prefix names one directory under the cache root: a plain, non-hidden name."""
    if not isinstance(prefix, str) or not prefix or "/" in prefix or "\\" in prefix or prefix.startswith("."):
        raise ConfigError(f"{field}={prefix!r} must be a plain directory name such as {example!r}")


def check_dynamic_dims(value: Any) -> None:
    """``{"arg": dim}`` or ``{"arg": (dim, ...)}``; names and dims are checked against the call later."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ConfigError(f"dynamic_dims={value!r} must map argument names to a dim or a tuple of dims")
    for name, dims in value.items():
        if not isinstance(name, str):
            raise ConfigError(f"dynamic_dims key {name!r} must be an argument name (str)")
        items = dims if isinstance(dims, (tuple, list)) else (dims,)
        if not items or not all(is_int(d) for d in items):
            raise ConfigError(
                f"dynamic_dims[{name!r}]={dims!r} must be an int or a tuple of ints (e.g. 0 or (0, 1))"
            )


def check_dynamic_dim_names(signature: inspect.Signature, dynamic_dims: Mapping[str, Any]) -> None:
    """Every name in ``dynamic_dims`` is a parameter of the forward (unless it takes ``**kwargs``)."""
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(dynamic_dims) - set(params))
    if unknown:
        raise ConfigError(f"dynamic_dims names {unknown}, but the forward takes {list(params)}")
