"""Unmodified Hugging Face causal LMs (random weights, small configs): prefill and generation."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

import tessera
from tessera import hf
from tests.child import run_json

pytestmark = pytest.mark.slow  # Hugging Face models, several processes: not in make test-fast

transformers = pytest.importorskip("transformers", reason="install tessera[hf] (make test does)")
# Both ends of what pyproject.toml admits run these tests: the newest release (constraints.txt,
# make test) and the oldest (make test-hf-oldest). 5.24 renamed the forward's past_key_values
# to cache (and 5.0 dropped cache_position).
MAJOR = int(transformers.__version__.split(".")[0])

LAYERS = 2
SMALL = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", SMALL),
    "mistral": ("MistralConfig", "MistralForCausalLM", SMALL),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", SMALL),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {**SMALL, "head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**SMALL, "pad_token_id": 0}),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {"vocab_size": 128, "n_embd": 64, "n_layer": LAYERS, "n_head": 4, "n_positions": 256},
    ),
}
LENGTHS = (7, 1, 16, 33, 64)
# StaticCache gives these families sliding-window layers whose length is a Python int: decode
# traces once more at the second step, with that length symbolic (see call_check.py).
SLIDING_WINDOW = {"mistral", "gemma3"}  # a first call of length 1 defers tracing (tested elsewhere)


def compiled_calls(compiled: tessera.CompiledModel) -> int:
    """Calls served by compiled traces: what each distinct backend's first piece ran."""
    backends = {id(e.split_model): e.split_model for e in compiled.traces}
    return sum(n for b in backends.values() for p in b.records()[:1] for _, n in p.served)


def build(family: str):
    config_name, model_name, sizes = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**sizes, attn_implementation="sdpa")
    return getattr(transformers, model_name)(config).eval(), config


def check_prefill(family: str, backend: str) -> None:
    model, _ = build(family)
    compiled = hf.compile_causal_lm(model, backend=backend)
    # A length of 1 has its own trace (Dynamo traces dynamic sizes as >= 2).
    with tessera.counters.expect(graphs_traced=1 + (1 in LENGTHS)):
        for n in LENGTHS:
            ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
            with torch.no_grad():
                expected = model(input_ids=ids, use_cache=False).logits
                got = compiled(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(got, expected, msg=lambda m, n=n: f"{family} length {n}: {m}")
    assert len(compiled.pieces) == 2 * LAYERS + 1  # one SDPA call per layer
    assert sum(p.is_splitting for p in compiled.pieces) == LAYERS


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_matches_eager_with_eager_compiler(family):
    check_prefill(family, "eager")


@pytest.mark.inductor
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_prefill_matches_eager_with_inductor(family):
    check_prefill(family, "inductor")


@pytest.mark.filterwarnings("error::FutureWarning")  # the cache passed under a deprecated name
@pytest.mark.parametrize(
    ("family", "backend"),
    [
        ("llama", "eager"),
        ("qwen2", "eager"),
        # Qwen2 is Llama's graph with biases: on Inductor it added 23 s of CI and nothing Llama's
        # run does not (the warm-process test below drops it for the same reason).
        pytest.param("llama", "inductor", marks=pytest.mark.inductor),
    ],
)
def test_greedy_generation_matches_eager_token_for_token(family, backend):
    model, config = build(family)
    prompt = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))

    def cache():
        return transformers.StaticCache(config=config, max_cache_len=64)

    expected = hf.greedy_generate(model, model, prompt, cache(), 32)
    prefill = hf.compile_causal_lm(model, backend=backend, prefix="prefill")
    decode = hf.compile_causal_lm(model, backend=backend, prefix="decode", dynamic_sequence=False)
    got = hf.greedy_generate(prefill, decode, prompt, cache(), 32)
    assert got.shape == (1, 32)
    assert torch.equal(got, expected)
    assert prefill.cache_dir is not None and decode.cache_dir is not None
    assert prefill.cache_dir.name == "prefill" and decode.cache_dir.name == "decode"
    assert prefill.cache_dir.parents[2] == decode.cache_dir.parents[2]  # one cache root


def test_the_cache_is_found_by_its_type_under_any_name_and_passed_as_the_forward_names_it():
    """transformers 5.24 renamed the forward's past_key_values to cache (the old name deprecated
    until 5.40): tessera.hf finds a cache by its type, positional or under any keyword."""
    model, config = build("llama")
    parameters = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in parameters else "past_key_values"
    assert hf.cache_parameter(model) == hf.cache_parameter(model.forward) == name
    cache = transformers.DynamicCache(config=config)
    inputs = hf.step_inputs(model, torch.ones(1, 1, dtype=torch.long), torch.tensor([0]), cache)
    assert inputs[name] is cache and ("cache_position" in inputs) == ("cache_position" in parameters)
    assert hf.find_cache((), {"any_name": cache, "past_key_values": None}) is cache
    assert hf.find_cache((torch.ones(1, 2), cache), {}) is cache
    assert hf.find_cache((), {"past_key_values": ((torch.ones(1),),)}) is None  # no Cache

    forward = hf.compile_for_generate(model, backend="eager")
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(9))
    compiled_cache, eager_cache = (
        transformers.DynamicCache(config=config),
        transformers.DynamicCache(config=config),
    )
    with torch.no_grad():
        for step in range(3):  # prefill, then decode at cache lengths 9 and 10; the cache positional
            got = model(ids, None, None, compiled_cache, use_cache=True).logits
            expected = forward.original(ids, None, None, eager_cache, use_cache=True).logits
            torch.testing.assert_close(got, expected, msg=lambda m, step=step: f"step {step}: {m}")
            ids = expected[:, -1:].argmax(-1)
    (compiled,) = forward.models
    assert compiled_calls(compiled) == 3 and len(compiled.traces) <= 3


@pytest.mark.skipif(
    MAJOR < 5,
    reason="CTRL's forward sets a plain attribute on transformers 4.x (one graph), a buffer from 5.0",
)
def test_a_family_with_graph_breaks_runs_guarded_equal_to_eager_and_names_its_breaks():
    """CTRL registers a buffer in forward: torch.compile(fullgraph=True) cannot trace it,
    torch.compile can, and so does tessera.compile (each graph compiled and cached by tessera)."""
    from benchmarks.hf_sweep import _build

    model, _ = _build("ctrl")
    model.requires_grad_(False)
    compiled = tessera.compile(model, backend="eager", dynamic_dims={"input_ids": 1})
    with pytest.warns(tessera.TesseraWarning, match=r"graph breaks.*modeling_ctrl\.py:\d+ in forward"):
        for n in (5, 9, 16, 9):
            ids = torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(n))
            expected = model(input_ids=ids, use_cache=False).logits
            torch.testing.assert_close(compiled(input_ids=ids, use_cache=False).logits, expected)
    report = compiled.report
    assert report is not None
    assert any(g.graph_break and "modeling_ctrl.py" in g.source for g in report.graphs)


def test_data_dependent_branch_names_cause_and_source_line():
    class Branchy(torch.nn.Module):
        def forward(self, input_ids):
            x = input_ids.float() * 2
            if x.sum() > 0:  # data-dependent: cannot be one graph
                return x + 1
            return x - 1

    compiled = tessera.compile(Branchy(), backend="eager", fullgraph=True)
    with pytest.raises(tessera.UnsupportedModelError) as caught:
        compiled(torch.ones(2, 4, dtype=torch.long))
    message = str(caught.value)
    assert "Data-dependent branching" in message
    assert "test_hf.py" in message and "if x.sum() > 0:" in message
    assert caught.value.__cause__ is None and caught.value.dynamo_error is not None


def _run_hf(tmp_path: Path, family: str, backend: str, out: str) -> dict:
    return run_json("tests.run_hf", family, backend, str(tmp_path / out), cache=tmp_path / "cache")


@pytest.mark.parametrize(
    ("family", "backend"),
    [
        # Three families warm in CI (its 30-minute budget); `tests.run_hf` serves all six, on
        # either compiler (`python -m tests.run_hf qwen2 inductor OUT`).
        *((family, "eager") for family in ("gemma3", "llama", "qwen2")),
        pytest.param("llama", "inductor", marks=pytest.mark.inductor),
    ],
)
def test_warm_process_generates_the_same_tokens_without_tracing(tmp_path, family, backend):
    """Prefill (dynamic length) and decode (StaticCache) both start from the whole-model artifact."""
    cold = _run_hf(tmp_path, family, backend, "cold.pt")
    warm = _run_hf(tmp_path, family, backend, "warm.pt")
    traces = 3 if family in SLIDING_WINDOW else 2
    assert cold["counters"]["graphs_traced"] == traces and cold["warm_start"] == [False, False]
    assert warm["warm_start"] == [True, True]
    assert warm["counters"]["graphs_traced"] == 0 and warm["counters"]["inductor_compiles"] == 0
    assert warm["counters"]["cache_hits"] == warm["counters"]["backend_compilations"] > 0
    cold_out, warm_out = torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")
    for length, tokens in cold_out["tokens"].items():
        assert torch.equal(tokens, cold_out["eager"][length]), f"{family} cold, prompt {length}"
        assert torch.equal(warm_out["tokens"][length], tokens), f"{family} warm, prompt {length}"


@pytest.mark.parametrize("family", ["bert", "vit"])
def test_encoders_with_a_dynamic_batch_match_eager(family):
    """Unmodified encoders: the batch dim (dim 0 of every input) is dynamic by default."""
    torch.manual_seed(0)
    sizes = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    if family == "bert":
        config = transformers.BertConfig(vocab_size=100, **sizes, attn_implementation="sdpa")
        model = transformers.BertModel(config).eval()

        def inputs(batch):
            ids = torch.randint(0, 100, (batch, 12), generator=torch.Generator().manual_seed(batch))
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    else:
        config = transformers.ViTConfig(image_size=32, patch_size=8, **sizes, attn_implementation="sdpa")
        model = transformers.ViTModel(config, add_pooling_layer=False).eval()

        def inputs(batch):
            return {
                "pixel_values": torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
            }

    compiled = tessera.compile(model, backend="eager")
    with tessera.counters.expect(graphs_traced=1), torch.no_grad():  # batch 1 included
        for batch in (3, 1, 2, 7):
            expected = model(**inputs(batch)).last_hidden_state
            torch.testing.assert_close(compiled(**inputs(batch)).last_hidden_state, expected)
    assert sum(p.is_splitting for p in compiled.pieces) == 2  # one SDPA call per layer


# -- generate() as people call it ---------------------------------------------------------------------
def _generations(model: Any) -> list[torch.Tensor]:
    """Greedy (prompts of 7 and of 1, one new token and several), a left-padded batch, and seeded
    sampling, with the model's default cache unless the caller patched generate's options."""
    prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(7))
    single = torch.randint(1, 128, (1, 1), generator=torch.Generator().manual_seed(1))
    padded = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(padded)
    padded[1, :3], mask[1, :3] = 0, 0
    greedy = {"do_sample": False, "pad_token_id": 0}
    out = [
        model.generate(prompt, max_new_tokens=10, **greedy),
        model.generate(prompt, max_new_tokens=1, **greedy),
        model.generate(single, max_new_tokens=5, **greedy),
        model.generate(padded, attention_mask=mask, max_new_tokens=6, **greedy),
    ]
    torch.manual_seed(3)
    out.append(model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0, pad_token_id=0))
    return out


@pytest.mark.filterwarnings("error::FutureWarning")  # the cache passed under a deprecated name
@pytest.mark.parametrize(
    ("family", "backend", "cache", "how"),
    [
        ("llama", "eager", None, "preset"),
        ("gpt2", "eager", None, "preset"),
        ("llama", "eager", "static", "preset"),
        ("mistral", "eager", "static", "preset"),  # sliding-window layers
        # Llama's graph with biases: in the extended tier, for CI's time (65 s of it).
        pytest.param("qwen2", "eager", None, "preset", marks=pytest.mark.extended),
        pytest.param("qwen2", "eager", "static", "preset", marks=pytest.mark.extended),
        ("llama", "eager", None, "idiom"),  # model.forward = tessera.compile(model.forward)
        # Inductor: test_a_warm_process_generates_the_same_tokens_without_tracing, cold and warm.
    ],
)
def test_generate_under_compile_for_generate_matches_eager(family, backend, cache, how, monkeypatch):
    model, _ = build(family)
    if cache is not None:
        model.generation_config.cache_implementation = cache
    expected = _generations(model)
    if how == "idiom":
        compiled = tessera.compile(model.forward, backend=backend)
        model.forward = compiled
    else:
        forward = hf.compile_for_generate(model, backend=backend)
        assert model.forward is forward
        (compiled,) = forward.models
    assert "attention_mask" in inspect.signature(model.forward).parameters  # generate() reads it
    got = _generations(model)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"{family}, {cache or 'dynamic'} cache, generation {i}"
    # Compiled code served every step of the three generations (prefill and decode: 3 + 9 + 5 + 5
    # calls at least), each kind of call traced once, within the limit of traces.
    assert compiled_calls(compiled) >= 3 + 9 + 5 + 5
    assert len(compiled.traces) <= compiled.compile_config.trace_limit
    if how == "idiom":
        return
    forward.restore()
    assert model.forward == forward.original


@pytest.mark.parametrize(
    ("cache", "backend", "how"),
    [
        ("static", "eager", "preset"),
        ("static", "eager", "idiom"),  # model.forward = tessera.compile(model.forward)
        pytest.param("dynamic", "inductor", "preset", marks=pytest.mark.inductor),
    ],
)
def test_a_warm_process_generates_the_same_tokens_without_tracing(tmp_path, cache, backend, how):
    def run(out: str) -> dict:
        return run_json(
            "tests.run_generate", "llama", backend, cache, str(tmp_path / out), how, cache=tmp_path / "c"
        )

    cold, warm = run("cold.pt"), run("warm.pt")
    assert cold["counters"]["graphs_traced"] >= 2 and cold["served"] > 0
    assert warm["counters"]["graphs_traced"] == 0 and warm["counters"].get("inductor_compiles", 0) == 0
    # Every call the cold process served compiled, the warm one does too (a trace the cold one
    # held back, made redundant by a wider one, leaves a call of its trace to the wider one).
    assert warm["warm_start"] == [True] and warm["served"] >= cold["served"]
    cold_out, warm_out = torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")
    for got, eager, again in zip(cold_out["tokens"], cold_out["eager"], warm_out["tokens"], strict=True):
        assert torch.equal(got, eager) and torch.equal(again, got)


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen2",  # a mask per attention type: a dict of tensors, dynamic in the trace
    ],
)
def test_a_static_cache_prefill_serves_prompts_of_several_lengths(family):
    """One prefill for left-padded batches of two lengths (one cache size: max_length)."""
    model, _ = build(family)
    model.generation_config.cache_implementation = "static"

    def generations() -> list[torch.Tensor]:
        out = []
        for n in (6, 9):
            ids = torch.randint(1, 128, (2, n), generator=torch.Generator().manual_seed(n))
            mask = torch.ones_like(ids)
            ids[1, :3], mask[1, :3] = 0, 0
            out.append(
                model.generate(ids, attention_mask=mask, max_length=16, do_sample=False, pad_token_id=0)
            )
        return out

    expected = generations()
    forward = hf.compile_for_generate(model, backend="eager")
    for got, want in zip(generations(), expected, strict=True):
        assert torch.equal(got, want)
    # The preset marks the prompt's length dynamic: the second length needs no trace of its own.
    (compiled,) = forward.models
    reasons = [e.reason for e in compiled.traces]
    assert len(reasons) <= 3 and not any("input_ids: size of dim 1" in r for r in reasons), reasons


def test_beam_search_under_compile_for_generate_matches_eager():
    model, _ = build("llama")
    prompt = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(7))
    options = {"max_new_tokens": 6, "num_beams": 3, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(prompt, **options)
    forward = hf.compile_for_generate(model, backend="eager")
    assert torch.equal(model.generate(prompt, **options), expected)
    (compiled,) = forward.models
    assert compiled_calls(compiled) == 6  # the prefill and 5 decode steps, all compiled
