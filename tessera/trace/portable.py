"""Dynamo's transformed bytecode in a portable form (``PortableCode``): captured after a trace
(``capture_code``), saved in the whole-model artifact, and run again by a later process without
importing Dynamo (``rebuild_call``)."""

from __future__ import annotations

import dis
import logging
import marshal
import pickle
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tessera import _compat
from tessera.cache.refusal import Refused
from tessera.trace.wrapper import ENTRY_GLOBALS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PortableCode:
    """Dynamo's transformed code object and the globals it reads, rebuildable in a new process.

    Constants ``marshal`` cannot hold (``torch.float32``, ``device('cpu')``) are replaced by
    placeholders and kept, pickled, in ``constants``; globals Dynamo installed are recorded as
    modules to import or objects to unpickle by reference. A module alias binds the module of the
    process that runs the code, so the code reads its globals at call time, as eager does; for the
    user's script that is the ``__main__`` of the warm process, not a copy of the traced one.
    """

    code: bytes
    constants: tuple[tuple[tuple[int, ...], Any], ...]  # (path to a const in nested code, value)
    modules: tuple[tuple[str, str], ...]  # (global name, module name)
    objects: tuple[tuple[str, bytes], ...]  # (global name, pickle of the object)
    compiled_fn: str  # the global through which the code calls the compiled graph
    # (module alias, the names the code reads from it): each must resolve before the code runs
    reads: tuple[tuple[str, tuple[str, ...]], ...]


def _instructions(code: types.CodeType) -> Iterator[list[dis.Instruction]]:
    """The instructions of ``code`` and of every code object nested in it, one list per code."""
    yield list(dis.get_instructions(code))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _instructions(const)


def _global_names(code: types.CodeType) -> Iterator[str]:
    for instructions in _instructions(code):
        for instruction in instructions:
            if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                yield str(instruction.argval)


def _names_read_from(code: types.CodeType, aliases: set[str]) -> dict[str, set[str]]:
    """Per module alias, the attributes the code loads from it (``__import___main__.SCALE``),
    directly or through a local: Dynamo keeps an alias it reads more than once in a temporary
    (``LOAD_GLOBAL alias; COPY 1; STORE_FAST tmp_1``, later ``LOAD_FAST tmp_1; LOAD_ATTR name``)."""
    reads: dict[str, set[str]] = {}
    for instructions in _instructions(code):
        held: dict[str, str] = {}  # local -> the alias it holds
        top: str | None = None  # the alias on top of the stack, if one is
        under: str | None = None  # a copy of it under the top (COPY 1 before a STORE_FAST)
        for instruction in instructions:
            op, arg = instruction.opname, str(instruction.argval)
            if op in ("LOAD_GLOBAL", "LOAD_NAME"):
                top, under = (arg if arg in aliases else None), None
            elif op in ("LOAD_FAST", "LOAD_FAST_CHECK"):
                top, under = held.get(arg), None
            elif op in ("COPY", "DUP_TOP") and instruction.argval in (1, None):
                under = top
            elif op == "STORE_FAST":
                if top is None:
                    held.pop(arg, None)
                else:
                    held[arg] = top
                top, under = under, None
            elif op in ("LOAD_ATTR", "LOAD_METHOD") and top is not None:
                reads.setdefault(top, set()).add(arg)
                top = under = None
            else:
                top = under = None
    return reads


def _strip_constants(
    code: types.CodeType, path: tuple[int, ...], found: list[tuple[tuple[int, ...], Any]]
) -> types.CodeType:
    consts = list(code.co_consts)
    for i, const in enumerate(consts):
        if isinstance(const, types.CodeType):
            consts[i] = _strip_constants(const, (*path, i), found)
            continue
        try:
            marshal.dumps(const)
        except ValueError:
            found.append(((*path, i), const))
            consts[i] = f"__tessera_constant_{len(found) - 1}__"
    return code.replace(co_consts=tuple(consts))


def _restore_constants(
    code: types.CodeType, by_path: dict[tuple[int, ...], Any], path: tuple[int, ...]
) -> types.CodeType:
    consts = list(code.co_consts)
    for i, const in enumerate(consts):
        here = (*path, i)
        if isinstance(const, types.CodeType):
            consts[i] = _restore_constants(const, by_path, here)
        elif here in by_path:
            consts[i] = by_path[here]
    return code.replace(co_consts=tuple(consts))


def capture_code(code: types.CodeType, func: types.FunctionType) -> PortableCode | Refused:
    """The portable form of ``code``, Dynamo's transformation of ``func``; or why it has none
    (something a new process cannot rebuild)."""
    compiled_fn = None
    modules: dict[str, str] = {}
    objects: dict[str, bytes] = {}
    namespace = func.__globals__
    for name in dict.fromkeys(_global_names(code)):
        if name in ENTRY_GLOBALS or name not in namespace:
            continue  # the entry frame's own, or a builtin
        value = namespace[name]
        if name.startswith(_compat.COMPILED_FN_PREFIX):
            compiled_fn = name
        elif isinstance(value, types.ModuleType):
            modules[name] = getattr(value, "_tessera_real", value.__name__)
        else:
            saved = _saved_object(name, value)
            if isinstance(saved, Refused):
                return saved
            objects[name] = saved
    if compiled_fn is None:
        return Refused("the bytecode does not call a compiled graph")
    reads = _names_read_from(code, set(modules))
    found: list[tuple[tuple[int, ...], Any]] = []
    stripped = _strip_constants(code, (), found)
    try:
        pickle.dumps([value for _, value in found])
    except Exception as e:
        return Refused(f"a constant of the bytecode cannot be saved: {e}")
    return PortableCode(
        code=marshal.dumps(stripped),
        constants=tuple(found),
        modules=tuple(sorted(modules.items())),
        objects=tuple(sorted(objects.items())),
        compiled_fn=compiled_fn,
        reads=tuple(sorted((alias, tuple(sorted(names))) for alias, names in reads.items())),
    )


def _saved_object(name: str, value: Any) -> bytes | Refused:
    """A global Dynamo installed that is no module, pickled (by reference for functions and
    classes: the warm process binds its own)."""
    if isinstance(value, dict):
        # A namespace Dynamo reads by identity (``___unnamed_scope``, the builtins' dict): a
        # pickled copy would be read instead of the live dict.
        return Refused(f"the bytecode reads {name}, a namespace that cannot be saved as a copy")
    try:
        return pickle.dumps(value)
    except Exception:
        return Refused(f"the bytecode reads {name} ({type(value).__name__}), which cannot be saved")


def resolve_globals(portable: PortableCode) -> dict[str, Any] | Refused:
    """The globals the saved code reads, bound in this process; or a Refused naming one that is not.

    Module aliases bind this process's modules (``__main__`` is the script now running), so a name
    the code reads from one must be defined here: it is checked now, not met at the first call.
    """
    bound: dict[str, Any] = {}
    for name, module_name in portable.modules:
        try:
            bound[name] = _compat.module_for_bytecode(module_name)
        except ImportError:
            return Refused(f"the bytecode reads module {module_name}, which does not import here")
    modules = dict(portable.modules)
    for alias, names in portable.reads:
        module = bound[alias]
        if isinstance(module, _compat.LazyModule):
            continue  # a stand-in for Dynamo's own module: what it lacks, the real module has
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            return Refused(f"the bytecode reads {modules[alias]}.{missing[0]}, which is not defined here")
    for name, blob in portable.objects:
        try:
            bound[name] = pickle.loads(blob)
        except (AttributeError, ImportError, pickle.UnpicklingError) as e:
            # Functions and classes are pickled by reference: one the script no longer defines.
            return Refused(f"the bytecode reads {name}, which does not load here ({e})")
    return bound


def rebuild_call(
    portable: PortableCode, entry: types.FunctionType, graph_callable: Callable[..., Any]
) -> Callable[..., Any] | Refused:
    """Dynamo's bytecode as a plain function again, calling ``graph_callable`` for the graph."""
    code = _restore_constants(marshal.loads(portable.code), dict(portable.constants), ())
    if code.co_freevars:
        return Refused("the saved bytecode expects a closure")
    bound = resolve_globals(portable)
    if isinstance(bound, Refused):
        return bound
    # A copy: the stand-ins for Dynamo's modules must not be in the entry frame's own globals,
    # where a later trace of it (a re-trace, bisection) would find them in place of the real ones.
    namespace = {**entry.__globals__, **bound}
    # Dynamo installs its compiled graph the same way: a uniquely named global of the frame.
    namespace[portable.compiled_fn] = graph_callable
    return types.FunctionType(code, namespace, entry.__name__)
