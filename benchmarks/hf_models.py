"""Hugging Face families: cold compile, first call and steady latency vs eager and stock; JSON.

Each (family, implementation) runs in its own process with an empty Inductor cache, so
"cold" means cold. Needs ``tessera[hf]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import child_env, header

LENGTHS = (16, 64)
FAMILIES = ("llama", "mistral", "qwen2", "gemma3", "phi3", "gpt2")


def _model(family: str) -> Any:
    import torch
    import transformers

    width = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4}
    heads = {"num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 512}
    specs = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {**width, **heads}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {**width, **heads}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {**width, **heads}),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**width, **heads, "head_dim": 32}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {**width, **heads, "pad_token_id": 0}),
        "gpt2": (
            "GPT2Config",
            "GPT2LMHeadModel",
            {"vocab_size": 1024, "n_embd": 256, "n_layer": 4, "n_head": 8},
        ),
    }
    config_name, model_name, sizes = specs[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**sizes, attn_implementation="sdpa")
    return getattr(transformers, model_name)(config).eval()


def child(family: str, impl: str) -> dict[str, Any]:
    import torch

    import tessera
    from tessera import hf
    from tessera.cli.timing import per_call_seconds

    model = _model(family)

    def ids(n: int) -> torch.Tensor:
        return torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(n))

    def logits(fn: Any) -> Any:
        return lambda x: fn(input_ids=x, use_cache=False).logits

    if impl == "tessera":
        compiled: Any = hf.compile_causal_lm(model, backend="inductor", disable_cache=True)
    else:
        compiled = torch.compile(model, backend="inductor", dynamic=True)
    start = time.perf_counter()
    with torch.no_grad():
        compiled(input_ids=ids(16), use_cache=False)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    with torch.no_grad():
        compiled(input_ids=ids(64), use_cache=False)
    first_call_s = time.perf_counter() - start
    steady = {n: per_call_seconds(logits(compiled), ids(n)) * 1e3 for n in LENGTHS}
    eager = {n: per_call_seconds(logits(model), ids(n)) * 1e3 for n in LENGTHS}
    return {
        "compile_s": compile_s,
        "first_call_other_length_s": first_call_s,
        "steady_ms": steady,
        "eager_ms": eager,
        "pieces": len(compiled.pieces) if impl == "tessera" else None,
        "counters": tessera.counters.snapshot(),
    }


def _run(family: str, impl: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as inductor_dir:
        env = child_env(TORCHINDUCTOR_CACHE_DIR=inductor_dir)
        cmd = [sys.executable, "-m", "benchmarks.hf_models", "--child", family, impl]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{family}/{impl} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs=2, metavar=("FAMILY", "IMPL"))
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0

    rows = []
    for family in args.families:
        ours, stock = _run(family, "tessera"), _run(family, "stock")
        rows.append(
            {
                "family": family,
                "pieces": ours["pieces"],
                "cold_compile_s": {"tessera": ours["compile_s"], "stock": stock["compile_s"]},
                "first_call_new_length_s": {
                    "tessera": ours["first_call_other_length_s"],
                    "stock": stock["first_call_other_length_s"],
                },
                "steady_ms": {
                    str(n): {
                        "eager": ours["eager_ms"][str(n)],
                        "stock": stock["steady_ms"][str(n)],
                        "tessera": ours["steady_ms"][str(n)],
                    }
                    for n in LENGTHS
                },
            }
        )
    result = {
        **header("hf_models"),
        "transformers": __import__("transformers").__version__,
        "model": "4 layers, width 256, 8 heads (4 kv), vocab 1024, random weights, batch 1",
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
