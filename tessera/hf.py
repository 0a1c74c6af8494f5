"""Hugging Face ``transformers`` models under tessera: the few things plain ``compile`` can't guess.

Install with ``pip install tessera[hf]``. The model is not edited: attention is cut where it calls
``torch.nn.functional.scaled_dot_product_attention`` (load it with ``attn_implementation="sdpa"``).
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from tessera import _compat
from tessera.api import CompiledModel
from tessera.api import compile as tessera_compile
from tessera.config import CompileConfig
from tessera.errors import ConfigError

log = logging.getLogger(__name__)

# The sequence dim of each input a causal LM's forward takes (batch is dim 0, kept static).
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
    ``past_key_values=``, ``cache_position=``) and ``ModelOutput`` results work unchanged. Use
    ``dynamic_sequence=False`` for a decode step (one new token: every shape is static).
    """
    dims = dict(SEQUENCE_DIMS) if dynamic_sequence else {}
    return tessera_compile(model, config, dynamic_dims=dims, prefix=prefix, **overrides)


# generate() passes a 2-D mask (batch, keys) or a 4-D one (batch, 1, queries, keys): the last dim
# is the key length in both. Marked "maybe dynamic", so a size the code fixes stays static.
_PREFILL_DIMS = {**SEQUENCE_DIMS, "attention_mask": -1}
_DECODE_DIMS = {"attention_mask": -1}


def compile_for_generate(
    model: torch.nn.Module, config: CompileConfig | None = None, **overrides: Any
) -> GenerateForward:
    """Make ``model.generate(...)`` run compiled, with the user's code unchanged.

    Replaces ``model.forward`` with a ``GenerateForward``: calls with an empty KV cache (prefill)
    go to one compiled model, traced once with the sequence length dynamic; calls with a filled
    cache (each decode step) go to another, traced once with the cache length dynamic, since a
    ``DynamicCache`` grows by one at every step. A ``StaticCache`` works the same way. Each is
    checked per call like any tessera model; artifacts are cached under the prefixes ``prefill``
    and ``decode``. Returns the new forward (``model.forward``); ``restore()`` undoes it.
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
    """``model.forward`` under ``compile_for_generate``: each kind of call compiled once.

    A kind is the phase (prefill: empty cache; decode: a filled one), the batch size, the cache's
    type and the
    keywords the call passes (generate() passes ``attention_mask`` only when it has one): each kind
    is one compiled model, traced at its first call and checked at every call.
    """

    MAX_KINDS = 8  # distinct kinds of call compiled, at most; more is a refusal naming them

    def __init__(
        self, model: torch.nn.Module, forward: Any, config: CompileConfig | None, overrides: dict[str, Any]
    ) -> None:
        self.model = model
        self.original = forward
        self._config = config
        self._overrides = overrides
        self.compiled: dict[tuple[str, int, str, frozenset[str]], CompiledModel] = {}
        self.eager_steps = 0  # decode steps run eagerly (a cache of length 1: see __call__)
        self.__signature__ = inspect.signature(forward)

    def _model_for(self, phase: str, kwargs: dict[str, Any]) -> CompiledModel:
        # The batch too: generate() keeps it fixed for a whole call, and traces stay static in it.
        batch = next((v.shape[0] for v in kwargs.values() if isinstance(v, torch.Tensor) and v.dim()), 0)
        cache = type(kwargs.get("past_key_values")).__name__
        given = frozenset(_given(k, v) for k, v in kwargs.items() if v is not None)
        kind = (phase, batch, cache, given)
        compiled = self.compiled.get(kind)
        if compiled is None:
            if len(self.compiled) >= self.MAX_KINDS:
                raise ConfigError(
                    f"compile_for_generate: more than {self.MAX_KINDS} kinds of call (phase, batch, "
                    f"cache, keywords): {sorted(map(str, self.compiled))}. Call restore() and compile "
                    "the kinds you use with tessera.compile"
                )
            dims = _PREFILL_DIMS if phase == "prefill" else _DECODE_DIMS
            compiled = tessera_compile(
                self.original, self._config, dynamic_dims=dims, prefix=phase, **self._overrides
            )
            compiled._soft_dims = True
            if phase == "decode":
                compiled._mark_nested = _mark_cache_lengths
            self.compiled[kind] = compiled
        return compiled

    @property
    def models(self) -> list[CompiledModel]:
        """The compiled models so far, one per kind of call."""
        return list(self.compiled.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        length = _cache_length(kwargs.get("past_key_values"))
        if not length:
            return self._model_for("prefill", kwargs)(*args, **kwargs)
        decode = self._model_for("decode", kwargs)
        # One layout for the cache at every step: prefill leaves its keys as views in the heads-
        # second order, while Inductor's decode writes them contiguous; the decode graph is traced
        # (and checked) for the layout it writes. A copy only where a tensor is not contiguous.
        _contiguous_cache(kwargs.get("past_key_values"))
        if decode.call_spec is None and length < 2:
            # Dynamo traces a dynamic size as >= 2: a decode traced at cache length 1 would be
            # static there and refuse the next step. This one step runs eagerly; the next compiles.
            if not self.eager_steps:
                log.info(
                    "decode step with a KV cache of length 1 runs eagerly; decode compiles at the next step"
                )
            self.eager_steps += 1
            return self.original(*args, **kwargs)
        return decode(*args, **kwargs)

    def restore(self) -> None:
        """Give the model its own forward back."""
        self.model.forward = self.original  # type: ignore[method-assign]


def _cache_layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    return list(layers) if isinstance(layers, (list, tuple)) else []


def _given(name: str, value: Any) -> str:
    """A keyword as a kind of call sees it: its name, and for a dict (a mask per attention type)
    which entries it fills."""
    if isinstance(value, dict):
        filled = ",".join(sorted(str(k) for k, v in value.items() if v is not None))
        return f"{name}[{filled}]"
    return name


def _contiguous_cache(cache: Any) -> None:
    for layer in _cache_layers(cache):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
                setattr(layer, name, tensor.contiguous())


def _cache_length(cache: Any) -> int:
    """How many positions a KV cache holds (0: none given, or empty)."""
    if cache is None:
        return 0
    length = getattr(cache, "get_seq_length", None)
    if callable(length):
        return int(length())
    return 0


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


def greedy_generate(
    prefill: Callable[..., Any],
    decode: Callable[..., Any],
    input_ids: torch.Tensor,
    cache: Any,
    max_new_tokens: int,
) -> torch.Tensor:
    """Greedy decoding with a static KV cache: one prefill call, then one decode call per token.

    ``prefill`` and ``decode`` are the model or compiled callables; ``cache`` is a
    ``transformers.StaticCache`` sized for the prompt plus ``max_new_tokens``. Returns the new
    tokens, shape [batch, max_new_tokens].
    """

    def next_token(step: Callable[..., Any], ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = step(
            input_ids=ids,
            position_ids=positions.unsqueeze(0),
            cache_position=positions,
            past_key_values=cache,
            use_cache=True,
        ).logits
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
