"""Subprocess helper: sliding-window ``generate()`` under ``hf.compile_for_generate``.

Usage: python -m tests.run_sliding FAMILY

A tiny model whose window (8 or 16) is smaller than prompt + 10 new tokens; greedy batch 1, then a
left-padded batch 2, each generation twice with ``wait_ready()`` between. Prints, as JSON, whether
each generation equals eager's (or the error it raised), tessera's warnings, and the counters.
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import transformers

import tessera
from tessera import hf

SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {**SMALL, "sliding_window": 16}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **SMALL,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            **SMALL,
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 0,
            "layer_types": ["sliding_attention", "sliding_attention"],
        },
    ),
}


def main() -> int:
    config_name, model_name, sizes = FAMILIES[sys.argv[1]]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**sizes, attn_implementation="sdpa")
    model = getattr(transformers, model_name)(config).eval()
    options = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    generator = torch.Generator().manual_seed(3)
    single = torch.randint(1, 128, (1, 9), generator=generator)
    pair = torch.randint(1, 128, (2, 10), generator=generator)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padded
    cases = [{"input_ids": single}, {"input_ids": pair, "attention_mask": mask}]
    expected = [model.generate(**case, **options) for case in cases]
    forward = hf.compile_for_generate(model)
    equal: list[bool | str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for case, tokens in zip(cases, expected, strict=True):
            for _ in range(2):
                try:
                    equal.append(bool(torch.equal(model.generate(**case, **options), tokens)))
                except Exception as e:  # reported, so that the test says which generation failed
                    equal.append(f"{type(e).__name__}: {str(e)[:300]}")
                for compiled in forward.models:
                    compiled.wait_ready(600)
    ours = [w for w in caught if issubclass(w.category, tessera.TesseraWarning)]
    said = [f"{w.category.__name__}: {w.message}" for w in ours]
    json.dump({"equal": equal, "warned": said, "counters": tessera.counters.snapshot()}, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
