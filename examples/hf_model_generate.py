"""``model.generate()`` on an unmodified Hugging Face model, compiled by tessera.

One call, ``hf.compile_for_generate(model)``, and generate() runs compiled code: prefill and each
decode step, with the default ``DynamicCache`` or a static cache. Run:
``python examples/hf_model_generate.py [--cache static] [--backend eager]``. Weights are random
(nothing is downloaded): the point is that tokens match eager exactly.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

from tessera import hf


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--cache", choices=["dynamic", "static"], default="dynamic")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).eval()
    prompt = torch.randint(1, config.vocab_size, (1, 12))
    options: dict[str, object] = {"max_new_tokens": args.new_tokens, "do_sample": False, "pad_token_id": 0}
    if args.cache == "static":
        options["cache_implementation"] = "static"
    expected = model.generate(prompt, **options)

    forward = hf.compile_for_generate(model, backend=args.backend)
    start = time.perf_counter()
    got = model.generate(prompt, **options)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(prompt, **options)
    second_s = time.perf_counter() - start
    print(f"{args.cache} cache, {args.new_tokens} tokens, match eager: {torch.equal(got, expected)}")
    print(f"first generate (compiles): {first_s:.2f}s, second: {second_s:.2f}s")
    print(f"compiled models: {[m.name for m in forward.models]}")
    return 0 if torch.equal(got, expected) else 1


if __name__ == "__main__":
    raise SystemExit(main())
