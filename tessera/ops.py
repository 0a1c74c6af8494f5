"""tessera's own custom ops: ``tessera::attention`` and ``tessera::decode_attention`` (splitting ops).

The fake implementation lets Dynamo and Inductor trace through it without running it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Registered with torch.library's define/impl rather than @torch.library.custom_op: custom_op
# wraps each kernel in torch._disable_dynamo, which imports all of Dynamo (~0.6 s) at the op's
# first call (torch 2.11-2.13), so every process running the model, eager or warm, paid for it.
# (torch.library's Library, define, impl and register_fake are untyped: the ignores below.)
_LIB = torch.library.Library("tessera", "DEF")  # type: ignore[no-untyped-call]
_LIB.define("attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor")  # type: ignore[no-untyped-call]
_LIB.define(  # type: ignore[no-untyped-call]
    "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor positions, float scale) -> Tensor"
)


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


@torch.library.register_fake("tessera::attention")  # type: ignore[untyped-decorator]
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


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


_LIB.impl("attention", attention, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
_LIB.impl("decode_attention", decode_attention, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


@torch.library.register_fake("tessera::decode_attention")  # type: ignore[untyped-decorator]
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
