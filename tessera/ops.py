"""tessera's own custom ops: ``tessera::attention``, the default splitting op.

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
