"""A small Llama-shaped model over a flat token sequence, for demos, tests and benchmarks.

Embedding, RMSNorm, rotary positions, attention through ``tessera::attention``, SwiGLU MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tessera.ops  # noqa: F401  (registers tessera::attention)


@dataclass(frozen=True)
class ToyLlamaConfig:
    """Sizes of the toy model; the defaults are tiny so that CPU tests stay fast."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 4096
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class Rotary(nn.Module):
    """Rotary position embedding with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D], positions: [T]
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ToyLlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = Rotary(config.head_dim, config.max_positions, config.rope_theta)
        self.scale = config.head_dim**-0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotary(q.view(-1, self.num_heads, self.head_dim), positions)
        k = self.rotary(k.view(-1, self.num_kv_heads, self.head_dim), positions)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.ops.tessera.attention(q, k, v, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class DecodeAttention(Attention):
    """Attention for one new token per sequence, with this layer's KV cache updated in place."""

    def __init__(self, config: ToyLlamaConfig, max_batch: int, max_len: int) -> None:
        super().__init__(config)
        cache_shape = (max_batch, max_len, config.num_kv_heads, config.head_dim)
        self.k_cache: torch.Tensor
        self.v_cache: torch.Tensor
        self.register_buffer("k_cache", torch.zeros(cache_shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [B, hidden], positions: [B] (one token per sequence)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.rotary(q.view(-1, self.num_heads, self.head_dim), positions)
        k = self.rotary(k.view(-1, self.num_kv_heads, self.head_dim), positions)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.ops.tessera.decode_attention(q, k, v, self.k_cache, self.v_cache, positions, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ToyLlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ToyLlamaConfig, attn: nn.Module | None = None) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.eps)
        self.attn = attn if attn is not None else Attention(config)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), positions)
        return x + self.mlp(self.post_attn_norm(x))


class ToyLlama(nn.Module):
    """``forward(input_ids [T], positions [T]) -> logits [T, vocab]`` over one flat sequence."""

    def __init__(self, config: ToyLlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x))


class ToyLlamaDecode(ToyLlama):
    """``forward(input_ids [B], positions [B]) -> logits [B, vocab]``: one decode step for B
    sequences (row b of every layer's KV cache is sequence b), caches updated in place."""

    def __init__(self, config: ToyLlamaConfig, max_batch: int, max_len: int) -> None:
        super().__init__(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, DecodeAttention(config, max_batch, max_len))
            for _ in range(config.num_layers)
        )

    def reset_cache(self) -> None:
        for module in self.modules():
            if isinstance(module, DecodeAttention):
                module.k_cache.zero_()
                module.v_cache.zero_()


def build_decode(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_batch: int = 64,
    max_len: int = 128,
    device: str | torch.device = "cpu",
    **sizes: Any,
) -> ToyLlamaDecode:
    """A decode-shaped ToyLlama (deterministic random weights, empty KV caches) for inference:
    eval mode, parameters frozen."""
    torch.manual_seed(seed)
    model = ToyLlamaDecode(ToyLlamaConfig(**sizes), max_batch, max_len)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build(seed: int = 0, dtype: torch.dtype = torch.float32, **sizes: Any) -> ToyLlama:
    """A ToyLlama for inference (eval mode, parameters frozen) with deterministic random weights;
    ``sizes`` override the config. Call ``requires_grad_(True)`` for a trainable one."""
    torch.manual_seed(seed)
    model = ToyLlama(ToyLlamaConfig(**sizes))
    return model.to(dtype).eval().requires_grad_(False)


def example_inputs(
    num_tokens: int, vocab_size: int = 256, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and positions ``0..T-1`` for one flat sequence of ``num_tokens`` tokens."""
    generator = torch.Generator().manual_seed(seed + num_tokens)
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=generator)
    return ids, torch.arange(num_tokens)
