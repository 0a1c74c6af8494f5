"""Greedy generation with an unmodified Hugging Face model under tessera.

Prefill (dynamic sequence length) and decode (one token, static shapes) are two compiled
callables sharing one cache root under the prefixes ``prefill`` and ``decode``; the KV cache is
transformers' ``StaticCache``. Run: ``python examples/hf_generate.py [--family qwen2]``.
Weights are random (nothing is downloaded): the point is that tokens match eager exactly.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import tessera
from tessera import hf


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=["llama", "qwen2"], default="llama")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[args.family]
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        attn_implementation="sdpa",
    )
    model = model_cls(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 12))

    def cache() -> transformers.StaticCache:
        return transformers.StaticCache(config=config, max_cache_len=prompt.shape[1] + args.new_tokens)

    start = time.perf_counter()
    expected = hf.greedy_generate(model, model, prompt, cache(), args.new_tokens)
    eager_s = time.perf_counter() - start

    prefill = hf.compile_causal_lm(model, backend=args.backend, prefix="prefill")
    decode = hf.compile_causal_lm(model, backend=args.backend, prefix="decode", dynamic_sequence=False)
    start = time.perf_counter()
    got = hf.greedy_generate(prefill, decode, prompt, cache(), args.new_tokens)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    hf.greedy_generate(prefill, decode, prompt, cache(), args.new_tokens)
    second_s = time.perf_counter() - start

    print(f"{args.family}: {args.new_tokens} tokens, match eager: {torch.equal(got, expected)}")
    print(f"  eager {eager_s:.2f}s | tessera first run (compile) {first_s:.2f}s | tessera {second_s:.2f}s")
    print(f"  tokens: {got[0].tolist()}")
    print(f"  caches: {prefill.cache_dir} and {decode.cache_dir}")
    print(f"  counters: {tessera.counters.snapshot()}")
    return 0 if torch.equal(got, expected) else 1


if __name__ == "__main__":
    raise SystemExit(main())
