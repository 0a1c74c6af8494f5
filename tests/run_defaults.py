"""Subprocess helper: models as a new user compiles them, with tessera's defaults, cold or warm.

Usage: python -m tests.run_defaults CASE [CASE ...]
Defaults means Inductor with the background compile on (the caller's environment must not set
TESSERA_BACKGROUND_COMPILE), grad enabled and frozen parameters. Each case makes calls of several
kinds (sizes, batches, generate() prompts) and compares every output with eager's; the process
then exits without waiting for anything (its traces must reach the cache by themselves). Prints
JSON at exit: per case the traces, how many were loaded, the counters, and the tessera warnings
raised; and ``at_exit``, the whole process's counters once its background work was done.
"""

from __future__ import annotations

import atexit
import json
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import tessera

Check = Callable[[Callable[..., Any]], list[Any]]


class Block(torch.nn.Module):
    """One attention block: SDPA is its splitting op."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (t.view(batch, length, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, length, 32))


def _sdpa() -> tuple[torch.nn.Module, Check]:
    torch.manual_seed(0)
    model = Block().eval()

    def calls(fn: Callable[..., Any]) -> list[Any]:
        return [fn(torch.randn(2, n, 32, generator=torch.Generator().manual_seed(n))) for n in (7, 19)]

    return model, calls


class Cached(torch.nn.Module):
    """Attention over a cache it returns, grown with ``cat`` as Hugging Face's DynamicCache grows
    it (the first step cats onto an empty tensor): eager returns it contiguous where Inductor, left
    alone, returns the new keys' transposed layout."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, _ = x.shape
        new = self.kv(x).view(batch, length, 4, 8).transpose(1, 2)
        cache = torch.cat([cache, new], dim=-2)
        attended = F.scaled_dot_product_attention(new, cache, cache)
        return attended.transpose(1, 2).reshape(batch, length, 32), cache


def _kv_cache() -> tuple[torch.nn.Module, Check]:
    torch.manual_seed(0)
    model = Cached().eval()

    def steps(fn: Callable[..., Any]) -> list[Any]:
        out = []
        for batch in (1, 3):
            cache = torch.empty(batch, 4, 0, 8)
            for length in (7, 1, 1, 1):  # a prefill, then decode steps on the returned cache
                x = torch.randn(batch, length, 32, generator=torch.Generator().manual_seed(length))
                hidden, cache = fn(x, cache)
                out += [hidden, cache]
        return out

    return model, steps


def _encoder(family: str) -> tuple[torch.nn.Module, Check]:
    import transformers

    torch.manual_seed(0)
    if family == "whisper":
        config = transformers.WhisperConfig(
            vocab_size=128,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
            d_model=64,
            encoder_layers=2,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            num_mel_bins=16,
            max_source_positions=64,
        )
        model = transformers.WhisperModel(config).get_encoder().eval()

        def audio(fn: Callable[..., Any]) -> list[Any]:
            return [
                fn(torch.randn(b, 16, 128, generator=torch.Generator().manual_seed(b))).last_hidden_state
                for b in (1, 3, 2)
            ]

        return model, audio
    name = {"bert": "Bert", "roberta": "Roberta", "distilbert": "DistilBert"}[family]
    options = {"vocab_size": 128, "max_position_embeddings": 80, "attn_implementation": "sdpa"}
    if family == "distilbert":
        options.update(dim=64, n_layers=2, n_heads=4, hidden_dim=128)
    else:
        options.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    config = getattr(transformers, f"{name}Config")(**options)
    model = getattr(transformers, f"{name}Model")(config).eval()

    def text(fn: Callable[..., Any]) -> list[Any]:
        out = []
        for batch, length in ((2, 9), (3, 17), (1, 5), (4, 33)):
            g = torch.Generator().manual_seed(batch * 100 + length)
            ids = torch.randint(3, 128, (batch, length), generator=g)
            mask = torch.ones_like(ids)
            mask[0, : length // 3] = 0
            out.append(fn(input_ids=ids, attention_mask=mask).last_hidden_state)
        return out

    return model, text


def _generate(family: str) -> tuple[torch.nn.Module, Check, Callable[[torch.nn.Module], Any]]:
    from tests.test_hf import build

    model, _ = build(family)

    def generations(fn: Callable[..., Any]) -> list[Any]:
        out = []
        for batch, length in ((1, 7), (2, 9), (3, 5)):
            g = torch.Generator().manual_seed(batch * 100 + length)
            ids = torch.randint(1, 128, (batch, length), generator=g)
            mask = torch.ones_like(ids)
            if batch > 1:
                ids[0, :2], mask[0, :2] = 0, 0
            out.append(fn(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0))
        return out

    def install(model: torch.nn.Module) -> Any:
        compiled = tessera.compile(model.forward)  # the idiom people write
        model.forward = compiled
        return compiled

    return model, generations, install


_MODELS = ("sdpa", "kv_cache", "bert", "roberta", "distilbert", "whisper")  # called, not generate()
CASES = (
    "sdpa",
    "kv_cache",
    "bert",
    "roberta",
    "distilbert",
    "whisper",
    "llama",
    "qwen2",
    "mistral",
    "gemma3",
)


def run(case: str) -> dict[str, Any]:
    if case == "sdpa":
        model, calls = _sdpa()
    elif case == "kv_cache":
        model, calls = _kv_cache()
    elif case in ("bert", "roberta", "distilbert", "whisper"):
        model, calls = _encoder(case)
    else:
        model, calls, install = _generate(case)
    model.requires_grad_(False)
    expected = calls(model.generate if case not in _MODELS else model)
    before = tessera.counters.snapshot()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tessera.TesseraWarning)
        if case in _MODELS:
            compiled = tessera.compile(model, prefix=case)
            got = calls(compiled)
        else:
            compiled = install(model)
            got = calls(model.generate)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, msg=lambda m, i=i: f"{case} call {i}: {m}")
        # Eager's layout too: an output fed back as the next call's input (a cache) must not
        # be laid out one way while a piece serves as traced and another once it is compiled.
        assert a.stride() == b.stride(), f"{case} output {i}: strides {a.stride()}, eager's {b.stride()}"
    return {
        "traces": len(compiled.traces),
        "loaded": sum(e.loaded for e in compiled.traces),
        "counters": _since(before),
        "warnings": [
            f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, Warning)
        ],
    }


def _since(before: dict[str, int]) -> dict[str, int]:
    after = tessera.counters.snapshot()
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def main() -> int:
    start = tessera.counters.snapshot()
    out: dict[str, Any] = {case: run(case) for case in sys.argv[1:]}

    def report() -> None:
        # The whole process's counters once its background work is done: the interpreter joins
        # tessera's background threads (the traces of calls served eagerly, the compiles) before
        # it runs the atexit hooks, so what they did after the last call counts too.
        out["at_exit"] = _since(start)
        json.dump(out, sys.stdout)
        sys.stdout.flush()

    atexit.register(report)  # no wait_ready: the traces reach the cache at a normal exit
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
