"""What a new user gets with the defaults: traces that converge and reach the cache.

Two fresh processes on one cache with Inductor and the background compile on (the suite's other
tests compile up front, see conftest.py): the second traces and compiles nothing. A saved trace
counts against ``max_traces`` like one made here; ``generate()`` through the idiom converges.
"""

from __future__ import annotations

import pytest
import torch

import tessera
from tests.child import run_json

GROUPS = {
    # two sequence lengths; a cache fed back (prefill, then decode steps); batch x length; batches
    "models": ("sdpa", "kv_cache", "bert", "roberta", "distilbert", "whisper"),
    # generate() through the model.forward idiom: prompts of several batches and lengths, padded
    "generate": ("llama",),
    # Llama's graph with biases, with a sliding window, and Gemma 3's (more traces, each layer's
    # attention of its own kind): in the extended tier (make test-extended), for CI's time (400 s
    # of it; Llama's run covers their path, test_hf's warm processes cover Gemma 3's traces).
    "generate-more": ("qwen2", "mistral", "gemma3"),
}


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize(
    "group",
    [
        pytest.param(group, marks=pytest.mark.extended) if group.endswith("-more") else group
        for group in sorted(GROUPS)
    ],
)
def test_a_second_process_with_the_defaults_traces_and_compiles_nothing(tmp_path, group):
    pytest.importorskip("transformers", reason="install tessera[hf] (make test does)")
    cases = GROUPS[group]

    def run() -> dict:
        return run_json(
            "tests.run_defaults",
            *cases,
            cache=tmp_path / "c",
            TESSERA_BACKGROUND_COMPILE="1",
            TESSERA_COMPILE_WORKERS="",  # the default: a worker compiles the general artifacts
        )

    cold, warm = run(), run()  # each compares every output with eager's, strides too
    for case in cases:
        # Cold: its calls traced, or served eagerly while their traces were made beside them (the
        # counters are read before the process exits, which waits for those traces).
        made = cold[case]["counters"]
        assert made.get("graphs_traced", 0) + made.get("served_eagerly", 0) >= 1, case
        assert warm[case]["counters"].get("graphs_traced", 0) == 0, (case, warm[case])
        assert warm[case]["counters"].get("served_eagerly", 0) == 0, (case, warm[case])
        assert warm[case]["counters"].get("inductor_compiles", 0) == 0, (case, warm[case])
        # Nothing to compile: no compile worker started either (a process, and torch imported).
        # A guard: these warm processes load whole-model artifacts and never reach the build,
        # where the pool is started only when the index lacks an artifact (that branch is
        # test_compile_workers' FakePool.started); the cold side's start happens after its
        # counters are read, in the background.
        assert warm[case]["counters"].get("compile_workers_started", 0) == 0, (case, warm[case])
        assert warm[case]["loaded"] == warm[case]["traces"] >= 1, (case, warm[case])
        assert cold[case]["warnings"] == warm[case]["warnings"] == [], case  # no CacheWarning
    # The whole processes, once their background work was done (at exit): the cold one compiled,
    # the warm one traced, compiled and started nothing then either.
    assert cold["at_exit"].get("inductor_compiles", 0) > 0, cold["at_exit"]
    for name in ("graphs_traced", "served_eagerly", "inductor_compiles", "compile_workers_started"):
        assert warm["at_exit"].get(name, 0) == 0, (name, warm["at_exit"])


class Flag(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: bool = True) -> torch.Tensor:
        return x * 2 if scale else x + 1


def test_max_traces_counts_the_traces_an_earlier_process_saved(tmp_path):
    x = torch.randn(4, 3)
    cold = tessera.compile(Flag(), backend="eager", cache_dir=str(tmp_path))
    cold(x), cold(x, False)
    assert len(cold.traces) == 2
    torch._dynamo.reset()
    strict = tessera.compile(Flag(), backend="eager", cache_dir=str(tmp_path), max_traces=1)
    torch.testing.assert_close(strict(x), x * 2)  # a saved trace serves the first kind
    assert strict.warm_start and [e.loaded for e in strict.traces] == [True]
    with pytest.raises(tessera.TesseraError, match="max_traces=1"):
        strict(x, False)  # saved too, but the limit is the limit
    torch._dynamo.reset()
    both = tessera.compile(Flag(), backend="eager", cache_dir=str(tmp_path), max_traces=2)
    both(x), both(x, False)
    assert [e.loaded for e in both.traces] == [True, True]
    assert tessera.counters.snapshot()["graphs_traced"] == 2  # the cold model's two, no more


@pytest.mark.slow
def test_generate_at_many_batches_and_lengths_converges_through_the_idiom():
    pytest.importorskip("transformers", reason="install tessera[hf] (make test does)")
    from tests.test_hf import build

    model, _ = build("llama")
    model.requires_grad_(False)
    calls = [(1, 8), (2, 9), (5, 21), (3, 1), (8, 64), (7, 2), (4, 13), (1, 1), (6, 33)]

    def generations() -> list[torch.Tensor]:
        out = []
        for i, (batch, length) in enumerate(calls):
            ids = torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(i))
            mask = torch.ones_like(ids)
            if batch > 1 and length > 2 and i % 2 == 0:  # left padding
                ids[0, : length // 2], mask[0, : length // 2] = 0, 0
            options = {"attention_mask": mask} if batch > 1 else {}
            out.append(model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **options))
        return out

    expected = generations()
    compiled = tessera.compile(model.forward, backend="eager", disable_cache=True)
    model.forward = compiled
    for i, (got, eager) in enumerate(zip(generations(), expected, strict=True)):
        assert torch.equal(got, eager), f"generation {i}: {calls[i]}"
    # Bounded by the kinds of call (prefill, decode; with and without a mask; sizes of 1), not by
    # the batches and lengths: 9 shapes of generation, 36 calls, within the default limit.
    assert len(compiled.traces) <= compiled.compile_config.trace_limit
