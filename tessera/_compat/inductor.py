"""Inductor: its config, standalone compile and artifacts, the vector ISA probe, custom passes.

Part of tessera._compat (see its docstring): the names are used as ``_compat.<name>``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from tessera._compat.patches import Undo, apply, patch

log = logging.getLogger(__name__)


# Inductor config keys that never change generated code, or that tessera sets itself per
# process (the ISA probe result): kept out of cache keys.
# Checked on torch 2.11, 2.13: names of Inductor's private config; no public cache-key API.
INDUCTOR_CONFIG_NOT_IN_KEY = frozenset({"cpp.vec_isa_ok", "post_grad_custom_post_pass"})


def inductor_config() -> Any:
    """``torch._inductor.config``, imported on first use.

    Checked on torch 2.11, 2.13: a private module; no public API reads or patches Inductor settings.
    """
    from torch._inductor import config

    return config


def inductor_config_names() -> set[str]:
    """Every Inductor setting's name (dotted for nested ones: ``cpp.simdlen``).

    Checked on torch 2.11, 2.13: ``get_config_copy`` of the private config; no public list.
    """
    return set(inductor_config().get_config_copy())


def inductor_config_repr() -> str:
    """The whole Inductor config as a string equal across processes with equal settings.

    Checked on torch 2.11, 2.13: the private config's ``save_config_portable``; no public fingerprint.
    """
    config = inductor_config()
    try:
        saved = config.save_config_portable()
    except Exception:  # older torch: the plain dict of settings
        saved = config.get_config_copy()
    return repr(
        sorted(
            (k, repr(v))
            for k, v in saved.items()
            if not k.startswith("_") and k not in INDUCTOR_CONFIG_NOT_IN_KEY
        )
    )


def inductor_config_overrides() -> str:
    """Inductor settings changed from their defaults, without importing Inductor.

    If the config module is not loaded, only ``TORCHINDUCTOR_*`` variables can have changed it.

    Checked on torch 2.11, 2.13: the private ``torch._inductor.config._config`` entries; no public API.
    """
    env = sorted((k, v) for k, v in os.environ.items() if _inductor_env_changes_code(k))
    module = sys.modules.get("torch._inductor.config")
    changed: list[tuple[str, str]] = []
    entries = getattr(module, "_config", None) if module is not None else None
    if isinstance(entries, dict):
        # Reading a deprecated setting warns (torch 2.15: use_mixed_mm): we only compare values.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for name, entry in entries.items():
                if name.startswith("_") or name in INDUCTOR_CONFIG_NOT_IN_KEY or _no_default(entry):
                    continue
                with contextlib.suppress(Exception):
                    value = getattr(module, name)
                    if value != getattr(entry, "default", value):
                        changed.append((name, repr(value)))
    return repr((env, sorted(changed)))


def _no_default(entry: Any) -> bool:
    """Whether a config entry has no default of its own to compare with: an alias of another
    config (``force_disable_caches`` is ``torch.compiler.config``'s) or one whose default is
    torch's unset sentinel (a plain ``object()``). Its value differs from that "default" as soon as
    the other config loads, so counting it made the fingerprint depend on whether anything in the
    process had compiled yet: a second model in a process never found its warm artifact. Such an
    entry counts only when the user set it (``user_override``, a ContextVar on torch 2.13).

    Checked on torch 2.11, 2.13: private config entries (``alias``, ``default``, ``user_override``).
    """
    if getattr(entry, "alias", None) is not None:
        return True
    if type(getattr(entry, "default", None)) is not object:
        return False
    read = getattr(getattr(entry, "user_override", None), "get", None)
    value = read() if callable(read) else None
    return value is None or type(value) is object


def _inductor_env_changes_code(name: str) -> bool:
    """Whether a ``TORCHINDUCTOR_*`` variable can change generated code (caches, threads: no).

    Checked on torch 2.11, 2.13: a rule over Inductor's variable names; reads no torch API.
    """
    if not name.startswith("TORCHINDUCTOR_"):
        return False
    return not any(word in name for word in ("CACHE", "THREADS", "WORKER", "TRACE", "DEBUG"))


def fresh_inductor_cache(directory: str) -> contextlib.AbstractContextManager[None]:
    """Inductor's caches (in memory and on disk) empty for the body, under ``directory``:
    ``torch._inductor.utils.fresh_cache``, as torch's own tests use it. Checked on torch 2.11-2.15;
    no public API."""
    from torch._inductor.utils import fresh_cache

    return fresh_cache(dir=directory)


def standalone_compile(
    graph: torch.fx.GraphModule, inputs: list[Any], dynamic_shapes: str, patches: dict[str, Any]
) -> Any:
    """``torch._inductor.standalone_compile`` across 2.11-2.13.

    Checked on torch 2.11, 2.13: private (``torch.compiler`` has no standalone compile of a graph).
    """
    import inspect

    from torch._inductor import standalone_compile as compile_

    if "donate_graph_module" not in inspect.signature(compile_).parameters:
        # torch < 2.12 (seen on 2.11) may rewrite the graph it is given; we keep using ours for
        # fallbacks and dumps, so hand it a copy. Remove once 2.12 is the oldest supported torch.
        import copy

        graph = copy.deepcopy(graph)
    return compile_(
        graph,
        inputs,
        dynamic_shapes=dynamic_shapes,  # type: ignore[arg-type]
        options={"config_patches": patches},
    )


# What an Inductor compile imports on its way, beyond compile_fx's own imports (read off
# sys.modules before and after a first CPU compile); a name a version lacks is skipped.
# Checked on torch 2.13: private modules of Inductor's; no public way to warm them.
_COMPILE_IMPORTS = (
    "torch._inductor.compile_fx",
    "torch._inductor.standalone_compile",
    "torch._inductor.bounds",
    "torch._inductor.choices",
    "torch._inductor.hooks",
    "torch._inductor.codegen.cpp",
    "torch._inductor.codegen.cpp_wrapper_cpu",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.fx_passes.post_grad",
    "torch._inductor.fx_passes.fuse_attention",
    "torch._inductor.fx_passes.mkldnn_fusion",
    "torch._inductor.fx_passes.pad_mm",
    "torch._inductor.fx_passes.quantization",
    "torch._inductor.fx_passes.freezing_patterns",
    "torch._inductor.fx_passes.efficient_conv_bn_eval",
    "torch.fx.experimental.validator",
    "torch.utils.cpp_extension",
)


def preload_inductor() -> None:
    """Import what an Inductor standalone compile imports (1-3 s on a small CPU): a compile
    worker pays it while its parent is still tracing, and a parent that compiles in a thread of
    its own pays it in the caller's thread first, so that the user's code never imports the same
    modules at the same moment (two threads importing one cycle of modules can hand either a
    partially initialized module). Checked on torch 2.11, 2.13: imports the private
    ``torch._inductor`` modules; nothing public to warm instead."""
    import importlib

    for name in _COMPILE_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError as e:  # a module this version lacks
            log.debug("not preloaded: %s (%s)", name, e)


def load_compiled_artifact(path: str) -> Any:
    """Inductor's own loader of a standalone-compile artifact (imports all of Inductor).

    Checked on torch 2.11, 2.13: the private ``torch._inductor.CompiledArtifact``; no public loader.
    """
    from torch._inductor import CompiledArtifact  # type: ignore[attr-defined]

    return CompiledArtifact.load(path=path, format="binary")


def find_compiled_graph(artifact: Any) -> Any | None:
    """The ``CompiledFxGraph`` inside a standalone-compile artifact, or None.

    There is no public accessor: walk the wrapper chain (closures and the ``compiled_fn`` /
    ``current_callable`` attributes) to the object holding the output code.

    Checked on torch 2.11, 2.13.
    """
    seen: set[int] = set()
    todo: list[Any] = [artifact]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or len(seen) > 500:
            continue
        seen.add(id(obj))
        if isinstance(getattr(obj, "source_code", None), str) and callable(
            getattr(obj, "current_callable", None)
        ):
            return obj
        for attr in ("_compiled_fn", "compiled_fn", "current_callable", "__wrapped__", "__func__"):
            value = getattr(obj, attr, None)
            if value is not None and not isinstance(value, (str, int, bool)):
                todo.append(value)
        for cell in getattr(obj, "__closure__", None) or ():
            with contextlib.suppress(ValueError):
                todo.append(cell.cell_contents)
    return None


def kernel_env() -> dict[str, str]:
    """What an Inductor C++ kernel module needs in the environment before it is loaded.

    torch 2.13 kernels find ``THPVariable_Unpack``-like helpers through this variable (set by
    ``CppPythonBindingsCodeCache``); torch 2.11 kernels need nothing.

    Checked on torch 2.11, 2.13: the private ``torch._C._dynamo.guards`` pointer; no public API.
    """
    guards = getattr(torch._C, "_dynamo", None)
    pointer = getattr(getattr(guards, "guards", None), "_torchinductor_pyobject_tensor_data_ptr", None)
    return {} if pointer is None else {"_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR": str(pointer)}


def extern_kernels() -> Any:
    """Inductor's namespace of extern kernels (``select_algorithm.extern_kernels``).

    Checked on torch 2.11, 2.13: private; what Inductor's generated code calls, no public name.
    """
    from torch._inductor.select_algorithm import extern_kernels as namespace

    return namespace


@functools.cache
def vec_isa_candidates() -> tuple[str, ...]:
    """The vector ISAs the CPU flags claim (x86), widest first, without Inductor's build probe.

    ``cpu_vec_isa.valid_vec_isa_list`` (torch 2.11-2.13) also compiles and loads a test program
    per candidate in a subprocess (~1 s warm, ~8 s on an empty Inductor cache). Uses its
    ``supported_vec_isa_list`` and ``x86_isa_checker``; anything unexpected gives ().

    Checked on torch 2.11, 2.13: private ``torch._inductor.cpu_vec_isa``; no public API.
    """
    try:
        import platform

        from torch._inductor import cpu_vec_isa

        if platform.machine() not in ("x86_64", "AMD64"):
            return ()
        flags = cpu_vec_isa.x86_isa_checker()
        return tuple(
            str(isa)
            for isa in cpu_vec_isa.supported_vec_isa_list
            if all(flag in flags for flag in str(isa).split())
        )
    except Exception as e:  # a torch without these helpers: never trust, always probe
        log.debug("cannot read the CPU's vector ISA candidates: %s", e)
        return ()


def picked_vec_isa() -> str:
    """The ISA Inductor generates CPU code for in this process (runs its probe if not yet run).

    Checked on torch 2.11, 2.13: private ``cpu_vec_isa.pick_vec_isa``; no public API.
    """
    from torch._inductor import cpu_vec_isa

    return str(cpu_vec_isa.pick_vec_isa())


@contextlib.contextmanager
def trusted_vec_isa(trust: bool) -> Iterator[None]:
    """Skip Inductor's per-process ISA probe when an earlier probe on this machine agreed with the flags.

    Checked on torch 2.11, 2.13: the private ``cpp.vec_isa_ok`` setting; no public way to skip it.
    """
    if not trust:
        yield
        return
    with inductor_config().patch({"cpp.vec_isa_ok": True}):
        yield


def custom_graph_pass_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomGraphPass`` (torch 2.11-2.15): the base of a pass
    Inductor runs post-grad and keys its FX graph cache on (``uuid()``). Checked on torch
    2.11-2.15: private module; no public base class."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


# Checked on torch 2.13 (2.15: not yet): tessera's own per-thread flag, read by the stand-in below.
_RNG_LEFT_ALONE = threading.local()  # per thread: a compile of tessera's beside the user's code


@contextlib.contextmanager
def rng_left_alone() -> Iterator[None]:
    """In this thread, until the block ends: a compile leaves the global random generator alone.

    Reason: Dynamo's, AOTAutograd's and Inductor's compiles save the global generator's state as
    they start and set it back as they end (``torch._dynamo.utils.preserve_rng_state``), so that
    a compile leaves it as it found it. In a background thread that undoes every draw the user's
    code made meanwhile, and the user's sampling repeats earlier numbers. A compile on fake tensors
    draws nothing (max_autotune's benchmarks do: tessera turns it off in such threads), so there
    it saves and restores nothing. Checked on torch 2.13 (2.15: not yet): installs the stand-in
    for the private ``preserve_rng_state`` where compiles read it."""
    from tessera._compat.guards import _flag_on

    _leave_rng_alone()
    with _flag_on(_RNG_LEFT_ALONE):
        yield


def rng_is_left_alone() -> bool:
    """Whether this thread is inside ``rng_left_alone`` (its compiles must not draw).
    Checked on torch 2.11-2.15: tessera's own flag; no torch API is used."""
    return bool(getattr(_RNG_LEFT_ALONE, "on", False))


# Where a compile reads ``preserve_rng_state`` by a name it imported (Inductor's compile_fx reads
# it through the module). Checked on torch 2.13 (2.15: not yet).
_PRESERVE_RNG_USERS = (
    "torch._functorch.aot_autograd",
    "torch._inductor.select_algorithm",
    "torch._inductor.codegen.triton",
)


def leave_rng_alone_where_loaded() -> None:
    """Install ``rng_left_alone``'s stand-in now if Dynamo is loaded (in the calling thread, so
    that a thread about to start imports nothing beside the user's imports); else the first
    ``rng_left_alone`` installs it. Checked on torch 2.13 (2.15: not yet)."""
    if "torch._dynamo.utils" in sys.modules:
        _leave_rng_alone()


def _leave_rng_alone() -> None:
    """Install the patch below where this torch needs it. Checked on torch 2.11, 2.13."""
    apply("rng_left_alone")


@patch("rng_left_alone", "compiles in tessera's threads leave the global generator alone", "2.11-2.15")
def _rng_left_alone() -> Undo | None:
    """Put a stand-in for ``preserve_rng_state`` where compiles read it: the original everywhere
    but in a thread inside ``rng_left_alone``. Checked on torch 2.13 (2.15: not yet); another
    torch without it: nothing done."""
    import torch._dynamo.utils as dynamo_utils

    original = getattr(dynamo_utils, "preserve_rng_state", None)
    if original is None:
        return None

    @functools.wraps(original)
    @contextlib.contextmanager
    def preserve_rng_state() -> Iterator[None]:
        if getattr(_RNG_LEFT_ALONE, "on", False):
            yield
            return
        with original():
            yield

    dynamo_utils.preserve_rng_state = preserve_rng_state
    # A module imported later takes the stand-in by its import; one imported already, here.
    for name in _PRESERVE_RNG_USERS:
        module = sys.modules.get(name)
        if getattr(module, "preserve_rng_state", None) is original:
            setattr(module, "preserve_rng_state", preserve_rng_state)  # noqa: B010

    restore: Any = original  # not None (checked above), for the closure

    def undo() -> None:
        dynamo_utils.preserve_rng_state = restore
        for name in _PRESERVE_RNG_USERS:
            module = sys.modules.get(name)
            if getattr(module, "preserve_rng_state", None) is preserve_rng_state:
                setattr(module, "preserve_rng_state", original)  # noqa: B010

    return undo
