"""Hugging Face ``transformers`` models under tessera: the few things plain ``compile`` can't guess.

Install with ``pip install tessera[hf]``. The model is not edited: attention is cut where it calls
``torch.nn.functional.scaled_dot_product_attention`` (load it with ``attn_implementation="sdpa"``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

from tessera import _compat
from tessera.api import CompiledModel, compile as tessera_compile
from tessera.config import CompileConfig
from tessera.errors import ConfigError

log = logging.getLogger(__name__)

# The sequence dim of each input a causal LM's forward takes (batch is dim 0, kept static). The
# KV cache is no tensor and has no entry. transformers 4.x also takes ``cache_position`` (5.x
# dropped it); a name the call does not pass is skipped.
SEQUENCE_DIMS = {
    "input_ids": 1,
    "inputs_embeds": 1,
    "attention_mask": 1,
    "position_ids": 1,
    "cache_position": 0,
}


def compile_causal_lm(
    model: torch.nn.Module,
    config: CompileConfig | None = None,
    *,
    dynamic_sequence: bool = True,
    prefix: str | None = None,
    **overrides: Any,
) -> CompiledModel:
    """Compile a causal LM's ``forward`` with the sequence length dynamic.

    Call it as the model: keyword arguments (``input_ids=``, ``position_ids=``, ``attention_mask=``,
    the KV cache as the installed transformers names it: ``cache=`` from 5.24, ``past_key_values=``
    and ``cache_position=`` before) and ``ModelOutput`` results work unchanged. Use
    ``dynamic_sequence=False`` for a decode step (one new token: every shape is static).
    """
    dims = dict(SEQUENCE_DIMS) if dynamic_sequence else {}
    return tessera_compile(model, config, dynamic_dims=dims, prefix=prefix, **overrides)


# generate() passes a 2-D mask (batch, keys) or a 4-D one (batch, 1, queries, keys): the last dim
# is the key length in both, and a 4-D mask's queries are the new tokens. Marked "maybe dynamic",
# so a size the code fixes (the batch of a 2-D mask) stays static.
_PREFILL_DIMS_4D_MASK: dict[str, int | tuple[int, ...]] = {**SEQUENCE_DIMS, "attention_mask": (-2, -1)}


def compile_for_generate(
    model: torch.nn.Module, config: CompileConfig | None = None, **overrides: Any
) -> GenerateForward:
    """Make ``model.generate(...)`` run compiled, with the user's code unchanged.

    A preset of the idiom ``model.forward = tessera.compile(model.forward)``, which works as well:
    it replaces ``model.forward`` with one compiled model whose traces (traces.py) are the kinds of
    call generate() makes (prefill, the first decode step, the later ones, with the default or the
    static cache), each traced at its first call. The preset saves re-traces by marking up front
    what grows (the prompt's length, the mask's keys, a dynamic cache's length: "maybe dynamic",
    so a size the code fixes stays static) and gives the cache one layout at every step. Returns
    the new forward (``model.forward``); ``restore()`` undoes it.
    """
    forward = model.forward
    if isinstance(forward, GenerateForward):
        raise ConfigError("compile_for_generate: this model's forward is already compiled for generate()")
    if not isinstance(forward, types.MethodType):
        raise ConfigError("compile_for_generate needs the model's own forward (model.forward was replaced)")
    wrapper = GenerateForward(model, forward, config, overrides)
    model.forward = wrapper  # type: ignore[method-assign]
    return wrapper


class GenerateForward:
    """``model.forward`` under ``compile_for_generate``: one compiled model, generate()'s dims
    suggested. The cache is found by its type (a ``transformers.Cache``), whatever argument carries
    it: generate() passes ``past_key_values=`` up to transformers 5.23 and ``cache=`` from 5.24."""

    def __init__(
        self, model: torch.nn.Module, forward: Any, config: CompileConfig | None, overrides: dict[str, Any]
    ) -> None:
        self.model = model
        self.original = forward
        self.compiled = tessera_compile(
            forward, config, dynamic_dims=_PREFILL_DIMS_4D_MASK, prefix="generate", **overrides
        )
        self.compiled.use_preset(soft_dims=True, mark_nested=_mark_growing)
        self.__signature__ = inspect.signature(forward)

    @property
    def models(self) -> list[CompiledModel]:
        """The compiled model (one: its traces are the kinds of call, ``models[0].traces``)."""
        return [self.compiled]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = find_cache(args, kwargs)
        if _cache_length(cache):
            # One layout for the cache at every step: prefill leaves its keys as views in the
            # heads-second order, while Inductor's decode writes them contiguous; a copy only
            # where a tensor is not contiguous, so decode steps share one trace.
            _contiguous_cache(cache)
        else:
            kwargs = _masks_of_their_own(kwargs)
        return self.compiled(*args, **kwargs)

    def restore(self) -> None:
        """Give the model its own forward back."""
        self.model.forward = self.original  # type: ignore[method-assign]


def _mark_growing(values: dict[str, Any]) -> None:
    """What grows in generate(): a dynamic cache's length, and each 4-D mask's queries and keys."""
    _mark_cache_lengths(values)
    _mark_mask_sequences(values)


@functools.cache
def _cache_class() -> type[Any]:
    import transformers  # tessera[hf]; imported at the first call, never by `import tessera`

    cache_class: type[Any] = transformers.Cache
    return cache_class


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers KV cache (``DynamicCache``, ``StaticCache``, ...)."""
    return isinstance(value, _cache_class())


def find_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The KV cache a call passes, positional or under any keyword, or None.

    Found by its type, not its argument's name: transformers 5.24 renamed the forward's
    ``past_key_values`` to ``cache`` (the old name works, deprecated, until 5.40).
    """
    return next((v for v in (*args, *kwargs.values()) if is_cache(v)), None)


def cache_parameter(func: Callable[..., Any]) -> str | None:
    """The name of the parameter of ``func`` that takes the KV cache (``cache`` from transformers
    5.24, ``past_key_values`` before): the one annotated with a ``transformers.Cache`` type."""
    signature = _signature(func)
    if signature is None:
        return None
    for name, parameter in signature.parameters.items():
        annotation = parameter.annotation
        if isinstance(annotation, str):  # a module with `from __future__ import annotations`
            if "Cache" in annotation:
                return name
        elif any(isinstance(t, type) and issubclass(t, _cache_class()) for t in _types_in(annotation)):
            return name
    return None


def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    """``func``'s signature (a module's: its forward's), its annotations evaluated where they resolve."""
    target = func.forward if isinstance(func, torch.nn.Module) else func
    for evaluate in (True, False):
        with contextlib.suppress(NameError, TypeError, ValueError):  # no signature, or a name unknown
            return inspect.signature(target, eval_str=evaluate)
    return None


def _types_in(annotation: Any) -> list[Any]:
    """``annotation`` and the types it is made of (``Cache | None`` -> Cache, NoneType)."""
    return [annotation, *(t for arg in typing.get_args(annotation) for t in _types_in(arg))]


def _cache_layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None) if is_cache(cache) else None
    return list(layers) if isinstance(layers, (list, tuple)) else []


def _contiguous_cache(cache: Any) -> None:
    for layer in _cache_layers(cache):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
                setattr(layer, name, tensor.contiguous())


def _cache_length(cache: Any) -> int:
    """How many positions a KV cache holds (0: none given, or empty). A ``StaticCache`` answers
    with a tensor (transformers 4.57 counts the filled slots; 5.24 keeps a counter)."""
    if not is_cache(cache):
        return 0
    return int(cache.get_seq_length())


def _mark_cache_lengths(values: dict[str, Any]) -> None:
    """The sequence dim of every tensor a dynamic KV cache holds: dynamic (it grows each step)."""
    dynamo = _compat.dynamo()
    for value in values.values():
        for layer in _cache_layers(value):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                # A StaticCache's tensors have a fixed length: only growing (dynamic) caches.
                if (
                    isinstance(tensor, torch.Tensor)
                    and tensor.dim() >= 2
                    and tensor.shape[-2] >= 2
                    and "Static" not in type(layer).__name__
                ):
                    dynamo.maybe_mark_dynamic(tensor, tensor.dim() - 2)


def _masks_of_their_own(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with each view in a dict of masks copied (transformers 4.x unsqueezes a 3-D mask
    per attention type): Dynamo traces a view argument through its base, whose dims are not marked,
    so the prefill would be static in the mask's queries."""
    copied = dict(kwargs)
    for name, value in kwargs.items():
        if isinstance(value, dict) and any(_is_view(v) for v in value.values()):
            copied[name] = {k: v.clone() if _is_view(v) else v for k, v in value.items()}
    return copied


def _is_view(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and _compat.is_view(value)


def _mark_mask_sequences(values: dict[str, Any]) -> None:
    """Prefill: the queries and keys dims of each 4-D mask in a dict of masks (one per attention
    type: Qwen2 and Gemma 3 get one with a static cache on transformers 4.x) are dynamic, as those
    of a 4-D mask passed alone are (``_PREFILL_DIMS_4D_MASK``)."""
    dynamo = _compat.dynamo()
    for value in values.values():
        if not isinstance(value, dict):
            continue
        for mask in value.values():
            if isinstance(mask, torch.Tensor) and mask.dim() == 4:
                for dim in (2, 3):
                    if mask.shape[dim] >= 2:
                        dynamo.maybe_mark_dynamic(mask, dim)


def greedy_generate(
    prefill: Callable[..., Any],
    decode: Callable[..., Any],
    input_ids: torch.Tensor,
    cache: Any,
    max_new_tokens: int,
) -> torch.Tensor:
    """Greedy decoding with a static KV cache: one prefill call, then one decode call per token.

    ``prefill`` and ``decode`` are the model or compiled callables; ``cache`` is a
    ``transformers.StaticCache`` sized for the prompt plus ``max_new_tokens``, passed under the name
    each callable's forward takes it by (``cache_parameter``). Returns the new tokens, shape
    [batch, max_new_tokens].
    """

    def next_token(step: Callable[..., Any], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = step(**step_inputs(step, ids, positions, cache), use_cache=True).logits
        tokens: torch.Tensor = logits[:, -1:].argmax(-1)  # [batch, 1]
        return tokens

    length = input_ids.shape[1]
    with torch.no_grad():
        token = next_token(prefill, input_ids, torch.arange(length, device=input_ids.device))
        generated = [token]
        for step in range(max_new_tokens - 1):
            token = next_token(decode, token, torch.tensor([length + step], device=input_ids.device))
            generated.append(token)
    return torch.cat(generated, dim=1)


def step_inputs(
    step: Callable[..., Any], ids: torch.Tensor, positions: torch.Tensor, cache: Any
) -> dict[str, Any]:
    """One step's keywords for ``step`` (a causal LM or its compiled forward): ``input_ids``,
    ``position_ids``, the cache under the name the forward takes it by (``cache_parameter``; with no
    annotation to go by, generate()'s own), and ``cache_position`` where the forward takes it
    (transformers 4.x: a ``StaticCache`` writes there; 5.x keeps its own counter)."""
    name = cache_parameter(step) or _generate_cache_parameter()
    inputs = {"input_ids": ids, "position_ids": positions.unsqueeze(0), name: cache}
    signature = _signature(step)
    if signature is not None and "cache_position" in signature.parameters:
        inputs["cache_position"] = positions
    return inputs


@functools.cache
def _generate_cache_parameter() -> str:
    """The keyword generate() passes the cache by, read from its ``prepare_inputs_for_generation``."""
    import transformers

    name = cache_parameter(transformers.GenerationMixin.prepare_inputs_for_generation)
    return name or "past_key_values"
