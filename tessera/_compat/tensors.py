"""Tensors, SymInts and op overloads: what tessera reads of them that has no public accessor.

Part of tessera._compat (see its docstring): the names are used as ``_compat.<name>``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two (real or fake) tensors are views of one storage."""
    try:
        return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
        return False


def sym_expr(value: torch.SymInt) -> Any:
    """The sympy expression behind a SymInt (``SymInt.node.expr``, torch 2.11-2.13)."""
    return value.node.expr


def is_constant_symint(value: torch.SymInt) -> bool:
    return not sym_expr(value).free_symbols


def size_hint(value: int | torch.SymInt) -> int:
    """The example value behind a size or stride: a SymInt's hint, an int itself."""
    if isinstance(value, int):
        return value
    try:  # torch 2.13 renamed hint_int to optimization_hint
        from torch.fx.experimental.symbolic_shapes import optimization_hint as hint
    except ImportError:  # torch 2.11-2.12
        from torch.fx.experimental.symbolic_shapes import hint_int as hint  # type: ignore[attr-defined,no-redef]
    return int(hint(value))


def version_counter(tensor: torch.Tensor) -> int:
    """A tensor's version counter, which an in-place write bumps (``Tensor._version``, torch
    2.11-2.15; no public accessor); -1 for an inference tensor, which has none."""
    try:
        return int(tensor._version)
    except RuntimeError:  # an inference tensor has no version counter (nor can it be written)
        return -1


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` views another's storage (``Tensor._is_view``, torch 2.11-2.15; fake
    tensors answer as the real ones would)."""
    return bool(tensor._is_view())


# The classes of ``torch.ops.ns.op`` and ``torch.ops.ns.op.overload`` (torch._ops, 2.11-2.13).
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


def op_schema_name(op: torch._ops.OpOverload) -> str:
    """``ns::op`` of an overload (``OpOverload._schema.name``, torch 2.11-2.13)."""
    return op._schema.name  # type: ignore[no-any-return]


def overload_of(op: torch._ops.OpOverload) -> str:
    """The overload's own name (``default``, ``Tensor``): ``OpOverload._overloadname``."""
    return op._overloadname  # type: ignore[no-any-return]


def op_overload_name(op: torch._ops.OpOverload) -> str:
    return f"{op_schema_name(op)}.{overload_of(op)}"


def op_is_mutable(op: torch._ops.OpOverload) -> bool:
    """Whether the op writes any argument (``OpOverload._schema.is_mutable``, torch 2.11-2.13)."""
    return bool(op._schema.is_mutable)


def packet_name(op: torch._ops.OpOverloadPacket) -> str:
    return op._qualified_op_name  # type: ignore[no-any-return]
