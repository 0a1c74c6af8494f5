"""PyTorch's default state and changes of it: grad enabled, inference mode, autocast, the default
dtype, input layouts and parameter dtypes. Each call equals eager or is refused by name.

Most calls here run with grad enabled, PyTorch's default: a ``torch.no_grad()`` or
``torch.inference_mode()`` below is the state under test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

import tessera
from tessera.models import toy_llama
from tessera.trace.call_check import GradientsNotSupportedError, InputMismatchError, StateMismatchError
from tests.child import run_json

SIZES = (3, 8, 5, 17)  # 8 is a compile size below; the others are not


def mlp(trainable: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)).eval()
    return model.requires_grad_(trainable)


def bf16_autocast() -> contextlib.AbstractContextManager[None]:
    return torch.autocast("cpu", dtype=torch.bfloat16)


# The states a call can be made in. "grad" is PyTorch's default (grad enabled).
STATES: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "grad": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "autocast": bf16_autocast,
}
# Grad mode and inference mode change nothing in an inference graph; autocast changes the graph.
FAMILY = {"grad": "plain", "no_grad": "plain", "inference_mode": "plain", "autocast": "autocast"}
MODES = {
    "piecewise": {"mode": "piecewise"},
    "trace_once": {"mode": "trace_once"},
    "graph_partition": {"mode": "piecewise", "graph_partition": True},
}


def check_states(model: torch.nn.Module, compiled: tessera.CompiledModel, first: str, sizes=SIZES) -> None:
    """First call under ``first``; then every state at every size: eager's numbers (a state that
    changes the graph is traced again), or with max_traces=1 a StateMismatchError exactly when the
    state differs from the traced one."""
    strict = compiled.compile_config.max_traces == 1
    for state in [first, *STATES]:
        for n in sizes:
            x = torch.randn(n, 64)
            with STATES[state]():
                expected = model(x)
                if FAMILY[state] != FAMILY[first] and strict:
                    with pytest.raises(StateMismatchError, match="autocast"):
                        compiled(x)
                    continue
                got = compiled(x)
            assert got.dtype == expected.dtype and got.requires_grad == expected.requires_grad
            torch.testing.assert_close(got, expected, msg=lambda m, s=state, n=n: f"{s} size {n}: {m}")


@pytest.mark.parametrize("first", sorted(STATES))
@pytest.mark.parametrize("mode", ["piecewise", "trace_once"])
@pytest.mark.parametrize("max_traces", [1, 8])
def test_every_state_equals_eager_or_is_refused_eager_compiler(mode, first, max_traces):
    model = mlp()
    compiled = tessera.compile(
        model, backend="eager", compile_sizes=[8], max_traces=max_traces, **MODES[mode]
    )
    check_states(model, compiled, first)
    # Two families of state (plain, autocast): one trace each, whatever the order.
    assert len(compiled.traces) == (1 if max_traces == 1 else 2)


@pytest.mark.inductor
@pytest.mark.parametrize("first", ["grad", "autocast"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_state_equals_eager_or_is_refused_inductor(mode, first):
    model = mlp()  # trace once: the re-trace for another state is the eager compiler's test above
    compiled = tessera.compile(model, backend="inductor", compile_sizes=[8], max_traces=1, **MODES[mode])
    check_states(model, compiled, first, sizes=(3, 8, 17))


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_result_that_needs_gradients_is_refused_then_inference_calls_work(backend):
    model = mlp(trainable=True)
    compiled = tessera.compile(model, backend=backend)
    x = torch.randn(4, 64)
    with pytest.raises(GradientsNotSupportedError, match=r"torch.no_grad\(\)"):
        compiled(x)  # grad enabled, parameters trainable: eager's result would need gradients
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    with pytest.raises(GradientsNotSupportedError, match=r"parameter 0\.(weight|bias)"):
        compiled(torch.randn(6, 64))  # after the trace too, and it names the parameter
    model.requires_grad_(False)  # frozen: grad enabled is served by the inference graph
    y = torch.randn(6, 64)
    got = compiled(y)
    assert not got.requires_grad
    torch.testing.assert_close(got, model(y))
    with pytest.raises(GradientsNotSupportedError):
        compiled(torch.randn(5, 64, requires_grad=True))  # an input that requires grad


def test_inputs_of_other_layouts_are_copied_or_refused():
    model = mlp()
    compiled = tessera.compile(model, backend="eager")
    compiled(torch.randn(4, 64))
    for x in (torch.randn(64, 6).t(), torch.randn(6, 128)[:, ::2], torch.randn(2, 9, 64)[:, 1]):
        torch.testing.assert_close(compiled(x), model(x))


def writes_to_its_input(x: torch.Tensor) -> torch.Tensor:
    x.mul_(2)
    return x.sum(-1)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_a_layout_change_is_served_or_refused_never_an_internal_assertion(backend):
    compiled = tessera.compile(torch.nn.Linear(8, 8).requires_grad_(False), backend=backend)
    with torch.inference_mode():
        compiled(torch.randn(8, 8))
        x = torch.randn(8, 8).t()
        torch.testing.assert_close(compiled(x), compiled.model(x))
    # The model writes to its input: a copy would lose the write, so the call is refused.
    writer = tessera.compile(writes_to_its_input, backend=backend)
    a = torch.randn(5, 8)
    expected = a * 2
    writer(a)
    torch.testing.assert_close(a, expected)
    with pytest.raises(InputMismatchError, match="layout"):
        writer(torch.randn(8, 5).t())


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_parameters_of_another_dtype_and_another_default_dtype_are_refused(backend):
    """Refused with max_traces=1; by default traced again (test_every_state_... shows it)."""
    model = mlp()
    compiled = tessera.compile(model, backend=backend, max_traces=1)
    x = torch.randn(4, 64)
    torch.testing.assert_close(compiled(x), model(x))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(StateMismatchError, match="default dtype"):
            compiled(torch.randn(4, 64, dtype=torch.float32))
    finally:
        torch.set_default_dtype(previous)
    model.to(torch.bfloat16)
    with pytest.raises(InputMismatchError, match=r"model\.0\.\w+: dtype"):
        compiled(torch.randn(4, 64))


def test_toy_llama_with_grad_enabled_equals_eager_at_every_size():
    model = toy_llama.build(num_layers=2)
    compiled = tessera.compile(model, backend="eager", compile_sizes=[4], compile_ranges=[8])
    for n in (2, 4, 7, 8, 13):
        ids, pos = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    trainable = toy_llama.build(num_layers=1).requires_grad_(True)
    with pytest.raises(GradientsNotSupportedError):
        tessera.compile(trainable, backend="eager")(*toy_llama.example_inputs(4))


@pytest.mark.inductor
def test_toy_llama_inductor_grad_enabled_then_inference_mode():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, compile_sizes=[4])
    for state in ("grad", "inference_mode", "no_grad"):
        for n in (4, 6):
            ids, pos = toy_llama.example_inputs(n)
            with STATES[state]():
                torch.testing.assert_close(compiled(ids, pos), model(ids, pos))


def test_hugging_face_model_with_grad_enabled():
    transformers = pytest.importorskip("transformers")
    from tessera import hf

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config).eval()  # trainable, as from_pretrained gives it
    compiled = hf.compile_causal_lm(model, backend="eager")
    ids = torch.randint(0, 128, (1, 9))
    with pytest.raises(GradientsNotSupportedError):
        compiled(input_ids=ids, use_cache=False)
    model.requires_grad_(False)
    for n in (9, 4, 21):
        ids = torch.randint(0, 128, (1, n))
        torch.testing.assert_close(
            compiled(input_ids=ids, use_cache=False).logits, model(input_ids=ids, use_cache=False).logits
        )
    with bf16_autocast():  # another state: traced again, and equal to eager under it
        torch.testing.assert_close(
            compiled(input_ids=ids, use_cache=False).logits,
            model(input_ids=ids, use_cache=False).logits,
            atol=2e-2,
            rtol=2e-2,
        )


def test_a_process_under_another_state_never_runs_that_states_artifact(tmp_path):
    cache = tmp_path / "cache"
    first = run_json("tests.run_state", "autocast", cache=cache)
    assert first == {"dtype": "torch.bfloat16", "equal": True, "warm": False, "traced": 1}
    plain = run_json("tests.run_state", "plain", cache=cache)
    assert plain == {"dtype": "torch.float32", "equal": True, "warm": False, "traced": 1}
    again = run_json("tests.run_state", "autocast", cache=cache)
    assert again == {"dtype": "torch.bfloat16", "equal": True, "warm": True, "traced": 0}
