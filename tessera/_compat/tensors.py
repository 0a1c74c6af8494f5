"""Tensors, SymInts and op overloads: what tessera reads of them that has no public accessor.

Part of tessera._compat (see its docstring): the names are used as ``_compat.<name>``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (real or fake) tensors are views of one storage.

    Checked on torch 2.11, 2.13: the private ``UntypedStorage._cdata``; a fake tensor's public
    ``data_ptr`` is 0 (and warns), so it cannot tell storages apart.
    """
    try:
        return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
        return False


def sym_expr(value: torch.SymInt) -> Any:
    """The sympy expression behind a SymInt (``SymInt.node.expr``).

    Checked on torch 2.11, 2.13: private; no public sympy view of a SymInt.
    """
    return value.node.expr


def symbol_ranks(example_inputs: Sequence[Any]) -> dict[str, int]:
    """Each backed size symbol's place in the order its shape env made them, by name: Dynamo makes
    them as it wraps the model's inputs, dim by dim, so ``input_ids [batch, length]`` gives batch
    before length (torch 2.13 names symbols by a hash of their source: ``s97``, ``s33``). Empty
    when no input has a symbol. Checked on torch 2.11-2.15: private ``SymNode.shape_env`` and
    ``ShapeEnv.backed_var_to_val`` (``var_to_val`` before 2.13; insertion-ordered); no public
    accessor."""
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            found = [value]
        elif isinstance(value, torch.Tensor):
            found = [d for d in (*value.shape, *value.stride()) if isinstance(d, torch.SymInt)]
        else:
            continue
        for symint in found:
            made = backed_hints(getattr(symint.node, "shape_env", None))
            if made:
                return {str(symbol): i for i, symbol in enumerate(made)}
    return {}


def backed_hints(shape_env: Any) -> dict[Any, Any] | None:
    """A shape env's backed symbols and their example values, in the order it made them; None
    when ``shape_env`` is None or has no such table.

    Checked on torch 2.11, 2.13: private ``ShapeEnv.backed_var_to_val`` (``var_to_val`` before
    2.13, insertion-ordered); no public accessor."""
    # torch 2.13 renamed var_to_val (deprecated, with a FutureWarning) to backed_var_to_val.
    made = getattr(shape_env, "backed_var_to_val", None)
    if made is None:
        made = getattr(shape_env, "var_to_val", None)
    return made


def is_constant_symint(value: torch.SymInt) -> bool:
    """Whether a SymInt's expression has no free symbols (a constant).

    Checked on torch 2.11, 2.13: through the private ``SymInt.node.expr`` (``sym_expr``).
    """
    return not sym_expr(value).free_symbols


def size_hint(value: int | torch.SymInt) -> int:
    """The example value behind a size or stride: a SymInt's hint, an int itself.

    Checked on torch 2.11, 2.13: ``symbolic_shapes.optimization_hint`` (2.13) or ``size_hint``
    (2.11, where ``hint_int`` warns that it is deprecated) of ``torch.fx.experimental``; no
    stable public API.
    """
    if isinstance(value, int):
        return value
    from torch.fx.experimental import symbolic_shapes

    # torch 2.13 renamed size_hint to optimization_hint; hint_int before both (2.12 was not run).
    for name in ("optimization_hint", "size_hint", "hint_int"):
        hint = getattr(symbolic_shapes, name, None)
        if hint is not None:
            return int(hint(value))
    raise ImportError("torch.fx.experimental.symbolic_shapes has no size hint function")


def is_plain_tensor(value: Any) -> bool:
    """Whether ``value`` is a tensor of no wrapper subclass (a parameter and a fake tensor are
    plain; a quantized or distributed wrapper, ``DTensor``, is not).

    Checked on torch 2.11, 2.13: ``torch.utils._python_dispatch`` is private.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return isinstance(value, torch.Tensor) and not is_traceable_wrapper_subclass(value)


def sympy_expression(text: str) -> Any:
    """The sympy expression ``str(expr)`` printed, for a size expression saved as text: torch's
    own sympy functions (``FloorDiv``, ``Mod``, ...) by their names.

    Checked on torch 2.11, 2.13: ``torch.utils._sympy.functions`` is private.
    """
    import sympy
    from torch.utils._sympy import functions

    return sympy.sympify(text, locals=vars(functions))


def version_counter(tensor: torch.Tensor) -> int:
    """A tensor's version counter, which an in-place write bumps (``Tensor._version``, torch
    2.11-2.15; no public accessor); -1 for an inference tensor, which has none.
    Checked on torch 2.11-2.15."""
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor has no version counter (nor can it be written)
        return -1


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` views another's storage (``Tensor._is_view``, torch 2.11-2.15; fake
    tensors answer as the real ones would). Checked on torch 2.11-2.15; no public accessor."""
    return bool(tensor._is_view())


# The classes of ``torch.ops.ns.op.overload`` and ``torch.ops.ns.op``.
# Checked on torch 2.11, 2.13: private ``torch._ops``; no public name for either class.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


def op_schema_name(op: torch._ops.OpOverload) -> str:
    """``ns::op`` of an overload (``OpOverload._schema.name``).

    Checked on torch 2.11, 2.13: private; the public ``name()`` adds the overload (not for default).
    """
    return op._schema.name  # type: ignore[no-any-return]


def overload_of(op: torch._ops.OpOverload) -> str:
    """The overload's own name (``default``, ``Tensor``): ``OpOverload._overloadname``.

    Checked on torch 2.11, 2.13: private; no public accessor.
    """
    return op._overloadname  # type: ignore[no-any-return]


def op_overload_name(op: torch._ops.OpOverload) -> str:
    """``ns::op.overload``, ``.default`` included (the public ``OpOverload.name()`` drops it).

    Checked on torch 2.11, 2.13: through the private ``_schema.name`` and ``_overloadname``.
    """
    return f"{op_schema_name(op)}.{overload_of(op)}"


def op_is_mutable(op: torch._ops.OpOverload) -> bool:
    """Whether the op writes any argument (``OpOverload._schema.is_mutable``).

    Checked on torch 2.11, 2.13: private ``_schema``; no public accessor.
    """
    return bool(op._schema.is_mutable)


def packet_name(op: torch._ops.OpOverloadPacket) -> str:
    """``ns::op`` of an op packet (``torch.ops.aten.add``).

    Checked on torch 2.11, 2.13: the private ``OpOverloadPacket._qualified_op_name``; no public one.
    """
    return op._qualified_op_name  # type: ignore[no-any-return]


def ops_of_the_users(graph: torch.fx.GraphModule) -> list[str]:
    """The ops ``graph`` calls that the user's code defined in Python (``torch.library.custom_op``
    or ``Library.define`` outside torch): a fresh process, such as a compile worker, does not
    have them, so a graph that calls one cannot be sent there.

    Checked on torch 2.13 (2.15: not yet): private ``torch._library.custom_ops.OPDEFS`` (each op's defining
    function) and ``torch.library._defs`` (every qualname Python defined); no public registry of
    who defined an op. Namespaces torch itself defines in Python are those known when this is
    first asked, less any op whose defining function is the user's."""
    from torch._library.custom_ops import OPDEFS

    found = []
    defined: set[str] = getattr(torch.library, "_defs", set())
    torch_namespaces = _torch_namespaces()
    for node in graph.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, OpOverload | OpOverloadPacket):
            continue
        name = str(target.name() if isinstance(target, OpOverload) else target._qualified_op_name)  # type: ignore[no-untyped-call]
        qualname = name.split(".", maxsplit=1)[0]
        custom = OPDEFS.get(qualname)
        if custom is not None:
            module = getattr(getattr(custom, "_init_fn", None), "__module__", "") or ""
            if not module.startswith("torch."):
                found.append(qualname)
        elif qualname in defined and qualname.split("::")[0] not in torch_namespaces:
            found.append(qualname)
    return sorted(set(found))


@functools.cache
def _torch_namespaces() -> frozenset[str]:
    """The op namespaces torch defines in Python itself (known when first asked).

    Checked on torch 2.13 (2.15: not yet): private ``torch.library._defs`` and ``OPDEFS``; no public list."""
    from torch._library.custom_ops import OPDEFS

    namespaces = set()
    for qualname in getattr(torch.library, "_defs", set()):
        custom = OPDEFS.get(qualname)
        module = getattr(getattr(custom, "_init_fn", None), "__module__", "torch.") or ""
        if module.startswith("torch."):
            namespaces.add(qualname.split("::")[0])
    return frozenset(namespaces)
