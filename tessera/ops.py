"""tessera's own custom ops: ``tessera::attention`` and ``tessera::decode_attention`` (splitting ops).

The fake implementation lets Dynamo and Inductor trace through it without running it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("tessera::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over one flat token sequence.

    q: [T, Hq, D], k/v: [T, Hkv, D] (Hq a multiple of Hkv) → [T, Hq, D].
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1).contiguous()


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("tessera::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode step for a batch of sequences; writes this step's k/v into the caches in place.

    q: [B, Hq, D], k/v: [B, Hkv, D], caches: [max_batch, max_len, Hkv, D] (row b is sequence b),
    positions: [B] (where this token goes) → [B, Hq, D], attending to positions 0..positions[b].
    """
    batch = q.shape[0]
    rows = torch.arange(batch, device=q.device)
    k_cache[rows, positions] = k
    v_cache[rows, positions] = v
    keys, values = k_cache[:batch], v_cache[:batch]  # [B, T, Hkv, D]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=2)
        values = values.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bhd,bthd->bht", q.float(), keys.float()) * scale
    visible = torch.arange(keys.shape[1], device=q.device)[None, :] <= positions[:, None]  # [B, T]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    return torch.einsum("bht,bthd->bhd", scores.softmax(-1), values.float()).to(q.dtype)


@decode_attention.register_fake
def _(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return torch.empty_like(q)
