"""A call's arguments in a trace's structure: which parameter each positional or keyword argument
is (``argument_names``), and how a call of one shape is rewritten as the trace was called
(``rewrite``, worked out once per shape; ``normalise`` for one call)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.trace.call_check import CallSpec, InputMismatchError, same_value, short_repr


def normalise(
    signature: inspect.Signature, spec: CallSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call rewritten in the traced call's structure (positional vs keyword), or
    InputMismatchError naming an argument the trace did not see (or saw and this call lacks)."""
    return rewrite(signature, spec, len(args), tuple(kwargs)).apply(args, kwargs)


# Where a traced argument comes from in a call: ("args", i), ("kwargs", key), or ("default", value).
Source = tuple[str, Any]


@dataclass(frozen=True)
class Rewrite:
    """How every call of one shape (its positional count and keyword names) is rewritten in a
    trace's structure: where each traced argument comes from, and the arguments the trace saw
    left to their default (a call that passes one is rewritten only while it passes the default).
    Made once per shape by ``rewrite``; ``apply`` reads no signature."""

    positional: tuple[Source, ...]
    keywords: tuple[tuple[str, Source], ...]
    dropped: tuple[tuple[str, Source, Any], ...] = ()  # (name, where passed, the default it must be)

    def apply(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` in the trace's structure; InputMismatchError where a dropped
        argument is passed with another value than its default."""
        for key, source, default in self.dropped:
            value = _read(source, args, kwargs)
            if default is _NO_DEFAULT or not same_value(value, default):
                raise InputMismatchError(
                    f"argument {key!r}: the trace was made without it, this call passes {short_repr(value)}"
                )
        return (
            tuple(_read(s, args, kwargs) for s in self.positional),
            {key: _read(s, args, kwargs) for key, s in self.keywords},
        )


_NO_DEFAULT = object()  # a dropped argument the signature gives no default: no call may pass it


def _read(source: Source, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    kind, key = source
    if kind == "args":
        return args[key]
    if kind == "kwargs":
        return kwargs[key]
    return key


class _Slot:
    """What stands for an argument while a call's shape is bound to the signature."""

    def __init__(self, source: Source) -> None:
        self.source = source


def rewrite(
    signature: inspect.Signature, spec: CallSpec, num_args: int, keywords: tuple[str, ...]
) -> Rewrite:
    """The rewrite of a call with ``num_args`` positional arguments and ``keywords`` into the
    traced call's structure (positional vs keyword, defaults filled in or dropped), or
    InputMismatchError naming an argument the trace did not see (or saw and this call lacks).
    Depends on the shape alone, so it can be worked out once per shape."""
    params = list(signature.parameters.values())
    slots = tuple(_Slot(("args", i)) for i in range(num_args))
    try:
        bound = signature.bind(*slots, **{key: _Slot(("kwargs", key)) for key in keywords})
    except TypeError as e:
        raise InputMismatchError(f"the call does not match the model's signature {signature}: {e}") from e
    values = dict(bound.arguments)
    var_positional = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
    var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    extra_keywords = dict(values.pop(var_keyword, {})) if var_keyword else {}
    positional: list[Source] = []
    for param in params:
        if len(positional) >= spec.num_args:
            break
        if param.kind is param.VAR_POSITIONAL:
            positional.extend(slot.source for slot in values.pop(param.name, ()))
        elif param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            if param.name in values:
                positional.append(values.pop(param.name).source)
            elif param.default is not param.empty:
                positional.append(("default", param.default))
    if var_positional is not None:
        extra = values.pop(var_positional, ())
        if num_args != spec.num_args and len(extra):
            raise InputMismatchError(
                f"*{var_positional}: the trace saw {spec.num_args} positional argument(s), "
                f"this call {num_args}"
            )
    named: list[tuple[str, Source]] = []
    for key in spec.keywords:
        if key in values:
            named.append((key, values.pop(key).source))
        elif key in extra_keywords:
            named.append((key, extra_keywords.pop(key).source))
        elif key in signature.parameters and signature.parameters[key].default is not inspect.Parameter.empty:
            named.append((key, ("default", signature.parameters[key].default)))
        else:
            raise InputMismatchError(f"argument {key!r}: the trace saw it passed, this call does not pass it")
    dropped = []
    for key, slot in {**values, **extra_keywords}.items():
        declared = signature.parameters.get(key)
        default = _NO_DEFAULT if declared is None or declared.default is declared.empty else declared.default
        dropped.append((key, slot.source, default))
    if len(positional) != spec.num_args:
        raise InputMismatchError(
            f"the trace saw {spec.num_args} positional argument(s), this call passes {len(positional)}"
        )
    return Rewrite(tuple(positional), tuple(named), tuple(dropped))


def argument_names(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, str]:
    """``args[i]`` / ``kwargs['k']`` -> the parameter name a user knows it by."""
    names: dict[str, str] = {f"kwargs[{key!r}]": key for key in kwargs}
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    for i in range(len(args)):
        param = positional[min(i, len(positional) - 1)] if positional else None
        if param is None:
            names[f"args[{i}]"] = f"argument {i}"
        elif param.kind is param.VAR_POSITIONAL:
            names[f"args[{i}]"] = f"{param.name}[{i - positional.index(param)}]"
        else:
            names[f"args[{i}]"] = param.name
    return names
