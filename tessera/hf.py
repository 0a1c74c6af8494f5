"""Hugging Face ``transformers`` models under tessera: the few things plain ``compile`` can't guess.

Install with ``pip install tessera[hf]``. The model is not edited: attention is cut where it calls
``torch.nn.functional.scaled_dot_product_attention`` (load it with ``attn_implementation="sdpa"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tessera.api import CompiledModel
from tessera.api import compile as tessera_compile
from tessera.config import CompileConfig

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
        return logits[:, -1:].argmax(-1)  # [batch, 1]

    length = input_ids.shape[1]
    with torch.no_grad():
        token = next_token(prefill, input_ids, torch.arange(length, device=input_ids.device))
        generated = [token]
        for step in range(max_new_tokens - 1):
            token = next_token(decode, token, torch.tensor([length + step], device=input_ids.device))
            generated.append(token)
    return torch.cat(generated, dim=1)
