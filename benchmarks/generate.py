"""Tokens per second of ``model.generate()``: eager, stock ``torch.compile`` and tessera, one process.

4-layer, width-256 Llama and Qwen2 with random weights, the default ``DynamicCache``, greedy, 64 new
tokens, batch 1 and 4. Each variant generates once to compile (not timed), then ``repeats`` times;
the best time counts. A decode step is the generate time less the prefill's, over the new tokens
after the first.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from benchmarks import header
from benchmarks.startup import HF_SIZES

NEW_TOKENS = 64
PROMPT = 16
SIZES = HF_SIZES  # the startup benchmark's Hugging Face models: 4 layers, width 256


def _build(family: str) -> Any:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    torch.manual_seed(0)
    return model_cls(config_cls(**SIZES, attn_implementation="sdpa")).eval()


def _best_seconds(model: Any, prompt: torch.Tensor, new_tokens: int, repeats: int) -> tuple[float, Any]:
    options = {
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "do_sample": False,
        "pad_token_id": 0,
    }
    out = model.generate(prompt, **options)  # compiles, where there is anything to compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model.generate(prompt, **options)
        best = min(best, time.perf_counter() - start)
    return best, out


def _variant(family: str, kind: str, prompt: torch.Tensor, repeats: int) -> dict[str, Any]:
    from tessera import hf

    model = _build(family)
    if kind == "stock":
        model.forward = torch.compile(model.forward, dynamic=True)  # type: ignore[method-assign]
    elif kind == "tessera":
        hf.compile_for_generate(model, backend="inductor", disable_cache=True)
    with torch.no_grad():
        total, tokens = _best_seconds(model, prompt, NEW_TOKENS, repeats)
        prefill, _ = _best_seconds(model, prompt, 1, repeats)
    step = (total - prefill) / (NEW_TOKENS - 1)
    return {
        "tokens_per_s": prompt.shape[0] * NEW_TOKENS / total,
        "generate_s": total,
        "prefill_s": prefill,
        "decode_step_ms": step * 1e3,
        "tokens": tokens,
    }


def run(families: list[str], batches: list[int], repeats: int) -> dict[str, Any]:
    rows = []
    for family in families:
        for batch in batches:
            prompt = torch.randint(
                1, SIZES["vocab_size"], (batch, PROMPT), generator=torch.Generator().manual_seed(0)
            )
            results = {
                kind: _variant(family, kind, prompt, repeats) for kind in ("eager", "stock", "tessera")
            }
            eager_tokens = results["eager"].pop("tokens")
            row: dict[str, Any] = {"family": family, "batch": batch}
            for kind, result in results.items():
                tokens = result.pop("tokens", eager_tokens)
                result["tokens_equal_eager"] = bool(torch.equal(tokens, eager_tokens))
                row[kind] = result
            row["tessera_over_stock_decode_step"] = (
                results["tessera"]["decode_step_ms"] / results["stock"]["decode_step_ms"]
            )
            rows.append(row)
    return {**header("generate"), "model": SIZES, "new_tokens": NEW_TOKENS, "prompt": PROMPT, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    quick = "--quick" in args
    families = ["llama"] if quick else ["llama", "qwen2"]
    print(json.dumps(run(families, [1] if quick else [1, 4], repeats=1 if quick else 3), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
