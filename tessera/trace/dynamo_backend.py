"""tessera as a Dynamo backend: ``torch.compile(model, backend="tessera", dynamic=True)``.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so a process finds
it by name without importing tessera. Here Dynamo keeps its guards and its own re-compiles; each
graph it hands over goes through tessera's split, per-size compile and content-addressed cache
(``receiver.GraphReceiver``, guarded), so a second process loads every piece and runs no Inductor compile.
``tessera.compile`` uses the same path for models with graph breaks (api.py).

What this path does not give: the guard-free call check and the Dynamo-free warm start of
``tessera.compile`` (Dynamo traces again in every process; only the compiles are saved).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tessera import validation
from tessera.config import CompileConfig
from tessera.errors import ConfigError
from tessera.report import GraphReport

# torch.compile(mode=...) as CompileConfig fields (fields given in options win).
TORCH_MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "reduce-overhead": {"cudagraph_mode": "piecewise"},
    "max-autotune-no-cudagraphs": {"inductor_config": {"max_autotune": True}},
    "max-autotune": {"inductor_config": {"max_autotune": True}, "cudagraph_mode": "piecewise"},
}
# Options that are not CompileConfig fields: the cache entry's directory name.
EXTRA_OPTIONS = ("prefix",)


def backend_config(options: Mapping[str, Any] | None = None, mode: str | None = None) -> CompileConfig:
    """The CompileConfig that ``torch.compile(..., options=options, mode=mode)`` asks for, checked
    as ``tessera.compile`` checks its keywords (a bad field or value is a ``ConfigError``)."""
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"options={options!r} must be a dict of CompileConfig fields")
    fields = {k: v for k, v in dict(options or {}).items() if k not in EXTRA_OPTIONS}
    if mode is not None and mode not in TORCH_MODES:
        raise ConfigError(
            f"torch.compile mode={mode!r} is not one tessera serves; use one of {list(TORCH_MODES)}"
        )
    for name, value in TORCH_MODES.get(mode or "default", {}).items():
        fields.setdefault(name, value)
    if "fullgraph" in fields:
        raise ConfigError("options fullgraph: under torch.compile, pass torch.compile(..., fullgraph=True)")
    if fields.get("mode", "piecewise") not in ("piecewise", "trace_once"):
        raise ConfigError(
            f"options mode={fields['mode']!r}: under torch.compile tessera compiles Dynamo's graphs, "
            "so the mode is 'piecewise' (split at attention) or 'trace_once' (one piece per graph)"
        )
    prefix = (options or {}).get("prefix", "dynamo")
    validation.check_prefix(prefix, "options prefix", "unet")
    config = CompileConfig().replace(**fields)
    if config.backend == "inductor":
        validation.check_inductor_keys(config.inductor_config)
    return config


def tessera_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """The function the ``tessera`` entry point names: Dynamo calls it once per graph."""
    from tessera.trace.receiver import GraphReceiver

    config = backend_config(options, mode)
    prefix = str((options or {}).get("prefix", "dynamo"))
    return GraphReceiver.for_guarded_path(config, prefix)(gm, example_inputs)


def graphs() -> tuple[GraphReport, ...]:
    """Every graph the tessera backend (and the graph-break path) compiled in this process, in order."""
    from tessera.trace import receiver

    return receiver.graphs()
