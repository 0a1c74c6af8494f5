"""The causal-LM catalogue: every family in transformers' auto mapping, tiny random config, prefill
at several lengths under eager, stock ``torch.compile(fullgraph=True, dynamic=True)`` and tessera.

One subprocess per family (a family that crashes or hangs costs only itself). Prints JSON: one row
per family (``built``, ``stock``, ``tessera``: "pass", or the first line of the error) and a summary.
Run: ``python -m benchmarks.hf_sweep [--families llama qwen2] [--timeout 180]``.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections import Counter
from typing import Any

import torch

from benchmarks import child_env, header

LENGTHS = (5, 9, 16)
# Tiny sizes, set on every config that has the attribute (each family names its own).
TINY = {
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "n_head": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
}


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _build(family: str) -> Any:
    import transformers

    config = transformers.AutoConfig.for_model(family)
    for name, value in TINY.items():
        if hasattr(config, name):
            setattr(config, name, value)
    torch.manual_seed(0)
    try:  # on a copy: a refused attention implementation stays set on the config it was tried on
        model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            copy.deepcopy(config), attn_implementation="sdpa"
        )
    except (ValueError, TypeError):  # a family without SDPA: its default attention
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return model.eval(), config


def _prefill(model: Any, call: Any, vocab: int) -> None:
    for n in LENGTHS:
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            expected = model(input_ids=ids, use_cache=False).logits
            got = call(input_ids=ids, use_cache=False).logits
        try:
            torch.testing.assert_close(got, expected)
        except AssertionError as e:
            raise AssertionError(f"length {n}: {e}") from None


def one(family: str) -> dict[str, Any]:
    """Build, then compare stock torch.compile and tessera (eager compilers: tracing is the test)."""
    import tessera
    from tessera import hf

    row: dict[str, Any] = {"family": family}
    try:
        model, config = _build(family)
    except Exception as e:
        return {**row, "built": _first_line(e)}
    row["built"] = "pass"
    vocab = min(int(getattr(config, "vocab_size", 128) or 128), 128)
    try:  # the tiny config must run in eager before any compiler is judged on it
        _prefill(model, model, vocab)
        row["eager"] = "pass"
    except Exception as e:
        return {**row, "eager": _first_line(e)}
    try:
        torch._dynamo.reset()
        _prefill(model, torch.compile(model, fullgraph=True, dynamic=True, backend="eager"), vocab)
        row["stock"] = "pass"
    except Exception as e:
        row["stock"] = _first_line(e)
    try:
        torch._dynamo.reset()
        compiled = hf.compile_causal_lm(model, backend="eager", disable_cache=True)
        _prefill(model, compiled, vocab)
        row["tessera"] = "pass"
    except Exception as e:
        row["tessera"] = _first_line(e)
    row["tessera_error_type"] = "" if row["tessera"] == "pass" else row["tessera"].split(":")[0]
    assert tessera is not None
    return row


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--one"]:
        print(json.dumps(one(args[1])))
        return 0
    timeout = int(args[args.index("--timeout") + 1]) if "--timeout" in args else 180
    chosen = args[args.index("--families") + 1 :] if "--families" in args else families()
    chosen = [f for f in chosen if not f.startswith("--")]
    rows = []
    for family in chosen:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.hf_sweep", "--one", family],
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            lines = proc.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if lines else {"family": family, "built": f"exit {proc.returncode}"}
        except subprocess.TimeoutExpired:
            row = {"family": family, "built": f"timeout after {timeout}s"}
        except json.JSONDecodeError:
            row = {"family": family, "built": "no report"}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    built = [r for r in rows if r.get("built") == "pass" and r.get("eager", "pass") == "pass"]
    summary = {
        "families": len(rows),
        "built": sum(r.get("built") == "pass" for r in rows),
        "run_in_eager": len(built),
        "stock_pass": sum(r.get("stock") == "pass" for r in built),
        "tessera_pass": sum(r.get("tessera") == "pass" for r in built),
        "stock_pass_tessera_fail": sorted(
            r["family"] for r in built if r.get("stock") == "pass" and r.get("tessera") != "pass"
        ),
        "tessera_failures": dict(
            Counter(r.get("tessera", "")[:80] for r in built if r.get("tessera") != "pass")
        ),
    }
    print(json.dumps({**header("hf_sweep"), "lengths": LENGTHS, "summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
