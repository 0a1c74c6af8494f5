"""Dynamo's guards and traced graphs as tessera reads them: guard facts, placeholders, source
names, the call state a guard compares, the globals a guard reads.

Part of tessera._compat (see its docstring): the names are used as ``_compat.<name>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import re
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from tessera._compat.bytecode import module_for_bytecode
from tessera._compat.patches import Undo, apply, patch
from tessera._compat.tensors import is_constant_symint, sym_expr

log = logging.getLogger(__name__)


def dynamo_source_name(expr: str) -> str:
    """``kwargs['x'].n`` (a guard's name) as Dynamo's full source name ``L['kwargs']['x'].n``.

    Checked on torch 2.11, 2.13: Dynamo's private source-name format; no public form.
    """
    root, rest = re.match(r"^(\w+)(.*)$", expr).groups()  # type: ignore[union-attr]
    return f"L[{root!r}]{rest}"


def guard_code(guard: Any) -> list[str]:
    """The Python expressions of a guard entry (``orig_guard.code_list``).

    Checked on torch 2.11, 2.13: ``orig_guard`` is Dynamo's private ``Guard``; no public accessor.
    """
    code = getattr(getattr(guard, "orig_guard", None), "code_list", None)
    return [c for c in code or () if isinstance(c, str)]


@dataclasses.dataclass(frozen=True)
class GuardFact:
    """One guard Dynamo produced, as tessera reads it (``GuardFilterEntry``).

    Checked on torch 2.11-2.15: what ``torch.compile``'s ``guard_filter_fn`` is given, kept plain.
    """

    kind: str  # Dynamo's guard type: "TENSOR_MATCH", "CONSTANT_MATCH", ...
    name: str  # its source, relative to the frame: ``args[0]``, ``kwargs['cache'].layers[0].keys``
    value: Any  # the guarded object, read before the first call ran (None when not has_value)
    has_value: bool
    is_global: bool
    code: tuple[str, ...]  # Dynamo's Python form of the guard, where it has one
    detail: tuple[tuple[str, str], ...] = ()  # string arguments of the guard (HASATTR's ``attr``)


def guard_fact(entry: Any) -> GuardFact:
    """A ``GuardFilterEntry`` (the argument of ``guard_filter_fn``) as a ``GuardFact``.

    Checked on torch 2.11, 2.13: its fields, and the private ``orig_guard`` they lead to.
    """
    has_value = bool(getattr(entry, "has_value", False))
    return GuardFact(
        kind=str(entry.guard_type),
        name=str(getattr(entry, "name", "") or ""),
        value=entry.value if has_value else None,
        has_value=has_value,
        is_global=bool(getattr(entry, "is_global", False)),
        code=tuple(guard_code(entry)),
        detail=_guard_detail(entry),
    )


def _guard_detail(entry: Any) -> tuple[tuple[str, str], ...]:
    """String arguments of a guard (HASATTR's ``attr``). Checked on torch 2.11-2.15: GuardBuilder
    methods bound with functools.partial carry them (attr=, key=) in the private
    ``orig_guard.create_fn.keywords``; the C++ guard has no Python form to read."""
    # A Source argument (DUPLICATE_INPUT's ``source_b``) is kept as its name: ``name`` is a method
    # up to torch 2.13 and a property after.
    create = getattr(getattr(entry, "orig_guard", None), "create_fn", None)
    keywords = getattr(create, "keywords", None) or {}
    out = []
    for key, argument in keywords.items():
        value = argument
        if not isinstance(value, str) and hasattr(value, "name") and hasattr(value, "guard_source"):
            value = value.name() if callable(value.name) else value.name
        if isinstance(value, str):
            out.append((key, value))
    return tuple(sorted(out))


def placeholder_values(gm: torch.fx.GraphModule) -> list[Any]:
    """The fake value of each graph input (SymInts and tensors with symbolic sizes), from the
    placeholders' ``example_value`` metadata. Checked on torch 2.11-2.15: Dynamo's node metadata, no
    public accessor."""
    return [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]


def placeholder_dims(gm: torch.fx.GraphModule) -> dict[str, tuple[str | None, ...]]:
    """Source name (``args[0]``) -> per dim of that graph input, the symbol Dynamo gave it (its
    expression as text), or None for a static dim. A dim Dynamo specialised (a default dim the
    code fixes) reads as static. Inputs Dynamo gave no source are left out.

    Checked on torch 2.11-2.15: Dynamo's node metadata and ``Source.name`` (``_tensor_inputs``).
    """
    return {
        name: tuple(d if isinstance(d, str) else None for d in dims)
        for _, name, dims in _tensor_inputs(gm)
        if name is not None
    }


def input_dims(gm: torch.fx.GraphModule) -> list[tuple[str, tuple[int | str, ...]]]:
    """Each tensor input of the graph, in the graph's order: its source name (``input_ids``,
    ``kwargs['x']``; ``input N`` where Dynamo left none) and per dim its size, or the name of the
    symbol Dynamo gave it where that is one bare symbol (a derived size, ``2*s0``, reads as its
    expression text).

    Checked on torch 2.11-2.15: Dynamo's node metadata and ``Source.name`` (``_tensor_inputs``).
    """
    return [(f"input {i}" if name is None else name, dims) for i, name, dims in _tensor_inputs(gm)]


def _tensor_inputs(gm: torch.fx.GraphModule) -> Iterator[tuple[int, str | None, tuple[int | str, ...]]]:
    """(placeholder index, source name or None, dims) of each tensor input, read from the
    placeholders' ``grapharg`` and ``example_value`` metadata.

    Checked on torch 2.11-2.15: Dynamo's node metadata and ``Source.name``; no public accessor.
    """
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor):
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = (
            None
            if source is None
            else local_source_name(source.name() if callable(source.name) else str(source.name))
        )
        dims = tuple(
            str(sym_expr(s)) if isinstance(s, torch.SymInt) and not is_constant_symint(s) else int(s)
            for s in value.shape
        )
        yield i, name, dims


def local_source_name(name: str) -> str:
    """Dynamo's ``L['kwargs']['x']`` as the guard-entry form ``kwargs['x']`` (the inverse of
    ``dynamo_source_name``). Checked on torch 2.11, 2.13: Dynamo's private source-name format."""
    return re.sub(r"\bL\[['\"](\w+)['\"]\]", r"\1", name)


def call_state() -> tuple[Any, ...]:
    """The global state a traced graph bakes in: autocast (per device: enabled, dtype), the default
    dtype, and the depth of the torch-function mode stack (``with torch.device(...)``,
    ``set_default_device``). Grad mode is handled apart (inference graphs, see api.py).

    Checked on torch 2.11-2.15: ``torch.get_autocast_dtype`` is public; the mode stack's depth is
    the private ``torch._C._len_torch_function_stack`` (no public accessor).
    """
    autocast = tuple(
        (device, torch.get_autocast_dtype(device))
        for device in AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )
    return (autocast, torch.get_default_dtype(), torch._C._len_torch_function_stack())


# Devices whose autocast state a call check compares (the ones torch 2.11-2.15 CPUs and GPUs use).
# Checked on torch 2.11-2.15: device names for the public ``torch.is_autocast_enabled(device)``.
AUTOCAST_DEVICES = ("cpu", "cuda")


def any_autocast() -> Callable[[], bool]:
    """A cheap test of whether any autocast is on (``torch._C._is_any_autocast_enabled``).

    Checked on torch 2.11-2.15: private; the public way asks ``torch.is_autocast_enabled`` per device.
    """
    return torch._C._is_any_autocast_enabled  # type: ignore[no-any-return]


def function_mode_depth() -> Callable[[], int]:
    """``torch._C._len_torch_function_stack``: > 0 under ``with torch.device()``.

    Checked on torch 2.11-2.15: private; no public depth of the torch-function mode stack.
    """
    return torch._C._len_torch_function_stack  # type: ignore[no-any-return]


class _GuardGlobals(dict):  # type: ignore[type-arg]
    """The traced frame's globals as Dynamo's guards name them (``G['__import_torch']``): names
    Dynamo installed in the cold process, resolved on demand in a warm one. Checked on torch
    2.11-2.15: Dynamo's private ``__import_*`` / ``__builtins_dict__*`` global names; no public API."""

    def __missing__(self, name: str) -> Any:
        # Dynamo's aliases (torch 2.11-2.15): __import_<module with '.' as '_dot_'>, and
        # __builtins_dict___<n> for the builtins' dict.
        if name.startswith("__import_"):
            value: Any = module_for_bytecode(name[len("__import_") :].replace("_dot_", "."))
        elif name.startswith("__builtins_dict__"):
            import builtins

            value = builtins.__dict__
        else:
            raise KeyError(name)
        self[name] = value
        return value


def guard_globals(namespace: dict[str, Any]) -> dict[str, Any]:
    """What ``G`` means in a guard's expression, for a frame whose globals are ``namespace``.

    Checked on torch 2.11, 2.13: Dynamo's private guard expressions; no public guard evaluator.
    """
    return _GuardGlobals(namespace)


# Checked on torch 2.11, 2.13: tessera's own per-thread flag, read by the stand-in below.
_GUARD_PROFILE_SKIPPED = threading.local()  # per thread: inside tessera's own trace


@contextlib.contextmanager
def guard_profile_skipped() -> Iterator[None]:
    """In this thread, until the block ends: Dynamo builds a trace's guards without timing them.

    Reason: once a trace's guards are built, Dynamo times one evaluation of them for a metric
    (``guard_latency_us``), and first evicts the CPU caches by writing a buffer larger than them,
    all in one C++ call that holds the GIL (``profile_guard_manager``, tens of ms).
    A call served beside tessera's trace waited for all of it, then ran from caches emptied of the
    model's weights. In tessera's traces the metric reads 0. Checked on torch 2.11, 2.13
    (``torch._dynamo.guards.profile_guard_manager``, a name the module imports from C++).
    """
    _skip_guard_profile()
    with _flag_on(_GUARD_PROFILE_SKIPPED):
        yield


@contextlib.contextmanager
def _flag_on(flag: threading.local) -> Iterator[None]:
    """``flag.on`` set in this thread until the block ends, then put back (blocks nest).

    Checked on torch 2.11-2.15: tessera's own flag; no torch API is used."""
    before = getattr(flag, "on", False)
    flag.on = True
    try:
        yield
    finally:
        flag.on = before


def _skip_guard_profile() -> None:
    """Install the patch below where this torch needs it. Checked on torch 2.11, 2.13."""
    apply("guard_profile")


@patch("guard_profile", "Dynamo's guard timing skipped in tessera's traces", "2.11-2.15")
def _guard_profile() -> Undo | None:
    """Put a stand-in for ``profile_guard_manager`` into Dynamo's guards module: the original
    everywhere but in a thread inside ``guard_profile_skipped``. Checked on torch 2.11, 2.13."""
    import torch._dynamo.guards  # noqa: F401  (the module must be loaded to be patched)

    module = sys.modules["torch._dynamo.guards"]
    original = getattr(module, "profile_guard_manager", None)
    if not callable(original):  # another torch: nothing to skip
        return None

    @functools.wraps(original)
    def profile_guard_manager(*args: Any, **kwargs: Any) -> Any:
        if getattr(_GUARD_PROFILE_SKIPPED, "on", False):
            return 0.0
        return original(*args, **kwargs)

    setattr(module, "profile_guard_manager", profile_guard_manager)  # noqa: B010  (a name only some torch has)
    return lambda: setattr(module, "profile_guard_manager", original)


# Checked on torch 2.13 (2.15: not yet): tessera's own per-thread flag, read by the stand-in below.
_OWN_TRACE = threading.local()  # per thread: inside one of tessera's traces (own_trace)


@contextlib.contextmanager
def own_trace() -> Iterator[None]:
    """Dynamo as tessera's traces need it, in this thread only: a function whose globals are not
    its module's dict is read through those globals (``inlined_globals_by_identity``).

    Checked on torch 2.13 (2.15: not yet): installs the stand-in for Dynamo's private
    ``get_globals_source_and_value``; no public way to choose how Dynamo reads globals."""
    _inlined_globals_by_identity()
    with _flag_on(_OWN_TRACE):
        yield


def _not_its_module(namespace: dict[str, Any]) -> bool:
    """Whether ``namespace`` (a function's globals) is not the dict of the module its
    ``__name__`` imports: a script run by ``python -m cProfile`` or ``python -m trace`` has
    globals named ``__main__`` while ``sys.modules['__main__']`` is the profiler's module.

    Checked on torch 2.13 (2.15: not yet): mirrors the module lookup of Dynamo's private
    ``InstructionTranslator.import_source``; no public equivalent."""
    name = namespace.get("__name__")
    module = sys.modules.get(name) if isinstance(name, str) else None
    return module is None or getattr(module, "__dict__", None) is not namespace


def _inlined_globals_by_identity() -> None:
    """Install the patch below where this torch needs it. Checked on torch 2.11, 2.13."""
    apply("inlined_globals")


@patch("inlined_globals", "an inlined function's globals read as they are, in tessera's traces", "2.13-2.15")
def _inlined_globals() -> Undo | None:
    """A stand-in for Dynamo's ``get_globals_source_and_value`` of an inlined function: where the
    function's globals are not its module's dict, they are read as the namespace they are (the
    branch Dynamo takes for a namedtuple's made-up scope) instead of through the module of that
    name, which lacks them. Everywhere else, and in every thread outside ``own_trace``, the
    original.

    Reason: tessera traces its own entry frame and inlines the model's forward, so the forward's
    globals are always an inlined function's; under ``python -m cProfile script.py`` Dynamo
    imports ``__main__`` (the profiler) for them, and the trace fails on
    ``G['__import___main__'].torch``. Stock ``torch.compile`` traces the forward as its root
    frame and never meets this. Checked on torch 2.13 (2.15: not yet): the private
    ``InliningInstructionTranslator.get_globals_source_and_value`` and
    ``OutputGraph.install_global_by_id``; another torch without them: nothing done."""
    try:
        from torch._dynamo.source import DictGetItemSource, GlobalSource
        from torch._dynamo.symbolic_convert import InliningInstructionTranslator
        from torch._dynamo.variables.builder import VariableBuilder
    except ImportError:
        return None
    original = getattr(InliningInstructionTranslator, "get_globals_source_and_value", None)
    if original is None:
        return None
    own = "get_globals_source_and_value" in vars(InliningInstructionTranslator)

    @functools.wraps(original)
    def get_globals_source_and_value(self: Any, name: str) -> Any:
        namespace = self.f_globals
        if not getattr(_OWN_TRACE, "on", False) or not _not_its_module(namespace):
            return original(self, name)
        scope = GlobalSource(self.output.install_global_by_id("___unnamed_scope", namespace))
        return namespace, VariableBuilder(self, scope)(namespace), DictGetItemSource(scope, name)

    InliningInstructionTranslator.get_globals_source_and_value = get_globals_source_and_value  # type: ignore[method-assign]

    def undo() -> None:
        if own:
            InliningInstructionTranslator.get_globals_source_and_value = original  # type: ignore[method-assign]
        else:  # the base class's, as before
            del InliningInstructionTranslator.get_globals_source_and_value

    return undo


def guard_build_abandoned() -> None:
    """Called by a guard filter about to raise (tessera ends a trace there, before its frame runs):
    Dynamo's guard builder lets go of the traced frame as its ``__init__`` would have at its end.

    Reason: ``CheckFunctionManager`` registers a ``weakref.finalize`` on each object it guards by
    identity (the model, its bound forward), whose callback holds the manager, and the manager
    holds the traced frame's locals (``output_graph``) until the end of its ``__init__``, which a
    raising filter never reaches: the model could then never be freed.

    Checked on torch 2.13 (2.15: not yet): ``CheckFunctionManager`` (private; ``_weakrefs``,
    ``output_graph``) calls the filter from its own ``__init__``. Another torch: nothing found,
    nothing done."""
    from torch._dynamo.guards import CheckFunctionManager

    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        manager = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
        if isinstance(manager, CheckFunctionManager):
            getattr(manager, "_weakrefs", {}).clear()
            manager.output_graph = None
            return
        frame = frame.f_back
