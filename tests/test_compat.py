"""Every entry of tessera/_compat/, exercised on the installed torch.

A torch release that moves a private API tessera uses fails a test here, by name, instead of a
user's trace or warm start. Run alone on any torch with ``make test-compat TORCH=2.15.0``.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from typing import Any

import pytest
import torch

import tessera
from tessera import _compat


# -- what one Dynamo trace gives tessera ------------------------------------------------------------
def traced(fn: Any, *args: Any, mark: tuple[int, ...] = ()) -> dict[str, Any]:
    """Trace ``fn(*args)`` once with Dynamo, keeping what tessera reads: the guard facts, the
    graph's placeholder dims, the transformed bytecode, the traced code objects."""
    seen: dict[str, Any] = {"codes": []}
    code = fn.__code__

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen["dims"] = _compat.placeholder_dims(gm)
        seen["traced_code"] = _compat.traced_code_objects()
        seen["gm"] = gm
        return gm.forward

    def keep(entries: list[Any]) -> list[bool]:
        seen["facts"] = [_compat.guard_fact(e) for e in entries]
        return [False] * len(entries)

    def hook(old: types.CodeType, new: types.CodeType) -> None:
        if old is code:
            seen["codes"].append(new)

    for position in mark:  # dim 0 of these arguments is dynamic
        _compat.dynamo().mark_dynamic(args[position], 0)
    handle = _compat.register_bytecode_hook(hook)
    try:
        with _compat.single_trace_settings():
            seen["output"] = torch.compile(
                fn, backend=backend, fullgraph=True, dynamic=False, options={"guard_filter_fn": keep}
            )(*args)
    finally:
        handle.remove()
        _compat.reset_code(code)
    return seen


def two_inputs(x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    return (x + y).relu() * n


def test_a_trace_gives_guard_facts_with_kinds_names_values_and_code():
    x, y = torch.randn(4, 3), torch.randn(4, 3)
    seen = traced(two_inputs, x, y, 2, mark=(0, 1))
    torch.testing.assert_close(seen["output"], two_inputs(x, y, 2))
    facts = seen["facts"]
    kinds = {f.kind for f in facts}
    assert {"TENSOR_MATCH", "SHAPE_ENV"} <= kinds
    tensor = next(f for f in facts if f.kind == "TENSOR_MATCH" and f.name == "x")
    assert tensor.has_value and tensor.value is x
    constant = next(f for f in facts if f.name == "n")
    assert constant.has_value and constant.value == 2
    shape = next(f for f in facts if f.kind == "SHAPE_ENV")
    assert any("size()[0]" in c for c in shape.code)  # the sizes' relations, as Python
    assert _compat.guard_code(object()) == []


def test_guard_detail_reads_string_and_source_arguments():
    def adds(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    x = torch.randn(3)
    facts = traced(adds, x, x)["facts"]  # one tensor through two sources
    duplicate = next(f for f in facts if f.kind == "DUPLICATE_INPUT")
    assert dict(duplicate.detail)["source_b"] in ("L['a']", "L['b']")


def test_placeholder_dims_name_each_dynamic_dim_by_its_symbol():
    seen = traced(two_inputs, torch.randn(4, 3), torch.randn(4, 3), 2, mark=(0, 1))
    dims = seen["dims"]
    assert set(dims) >= {"x", "y"}
    assert dims["x"][0] is not None and dims["x"][1] is None
    assert dims["y"][0] == dims["x"][0]  # x + y: one symbol


def test_traced_code_objects_name_the_traced_function():
    seen = traced(two_inputs, torch.randn(4, 3), torch.randn(4, 3), 2)
    assert seen["traced_code"] is not None
    assert two_inputs.__code__ in seen["traced_code"]


def test_the_bytecode_hook_sees_the_transformed_code_and_it_calls_the_compiled_graph():
    seen = traced(two_inputs, torch.randn(4, 3), torch.randn(4, 3), 2)
    (code,) = seen["codes"]
    names = set(code.co_names)
    assert any(n.startswith(_compat.COMPILED_FN_PREFIX) for n in names)


def test_source_names_round_trip():
    assert _compat.dynamo_source_name("kwargs['x'].n") == "L['kwargs']['x'].n"
    assert _compat.local_source_name("L['kwargs']['x'].n") == "kwargs['x'].n"
    assert _compat.local_source_name("f(L['args'][0], L['kwargs']['y'])") == "f(args[0], kwargs['y'])"


def test_trace_settings_make_state_ints_symbolic_and_restore_the_mha_switch():
    before = torch.backends.mha.get_fastpath_enabled()
    with _compat.single_trace_settings(("kwargs['cache'].n",), size_oblivious=True):
        assert torch.backends.mha.get_fastpath_enabled() is False
    assert torch.backends.mha.get_fastpath_enabled() is before
    assert _compat.supports_dynamic_state() is True


def test_mark_unbacked_traces_size_one_without_specialising():
    x = torch.randn(1, 3)
    _compat.mark_unbacked(x, 0)
    seen = traced(lambda t: t * 2, x)
    assert seen["dims"]["t"][0] is not None


def test_dim_marks_are_restored_as_they_were():
    dynamo = _compat.dynamo()
    fresh, marked = torch.randn(3, 4), torch.randn(3, 4)
    dynamo.mark_dynamic(marked, 1)
    before = {k: v for k, v in marked.__dict__.items()}
    with _compat.dim_marks_restored([fresh, marked]):
        dynamo.mark_dynamic(fresh, 0)
        dynamo.maybe_mark_dynamic(marked, 0)
        _compat.mark_unbacked(fresh, 1)
        assert fresh.__dict__ and marked.__dict__ != before
    assert fresh.__dict__ == {}, "every attribute the marks set is gone"
    assert marked.__dict__ == before, "the caller's own marks are kept"
    # Dynamo sees an unmarked tensor again: a stock compile traces it static, no guard failure.
    torch.testing.assert_close(torch.compile(lambda t: t * 2, backend="eager")(fresh), fresh * 2)


def test_graph_compile_reason_names_the_break_and_its_line_and_placeholders_have_values():
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    def breaks(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if y.sum() > 0:  # the break
            return y + 1
        return y - 1

    x = torch.ones(3, 4)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(breaks, backend=capture)(x)
    reason, where, is_break = _compat.graph_compile_reason(graphs[0])
    assert is_break and reason and "test_compat.py" in where and "in breaks" in where
    assert _compat.graph_compile_reason(graphs[-1])[2] is False, "the last graph returns"
    values = _compat.placeholder_values(graphs[0])
    assert any(isinstance(v, torch.SymInt) for v in values) or any(
        isinstance(v, torch.Tensor) and isinstance(v.shape[0], torch.SymInt) for v in values
    )


def test_graph_source_is_the_code_without_compiling_the_lazy_graph():
    seen: dict[str, Any] = {}

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen["source"] = _compat.graph_source(gm)
        seen["still_lazy"] = type(gm)._needs_recompile()  # type: ignore[attr-defined]
        seen["gm"] = gm
        return gm.forward

    x = torch.randn(3, 4)
    out = torch.compile(two_inputs, backend=backend, fullgraph=True)(x, x, 3)
    torch.testing.assert_close(out, two_inputs(x, x, 3))
    assert seen["still_lazy"], "reading the source compiled the graph's forward"
    assert "relu" in seen["source"]
    assert seen["source"] == seen["gm"].code  # compiled now (the call ran it): the same text


def test_guard_timing_is_skipped_in_tesseras_traces_only(monkeypatch):
    import torch._dynamo.guards as guards

    with _compat.guard_profile_skipped():
        stand_in = guards.profile_guard_manager
    returned: list[Any] = []

    def seen(*args: Any) -> Any:
        returned.append(stand_in(*args))
        return returned[-1]

    monkeypatch.setattr(guards, "profile_guard_manager", seen)
    x = torch.randn(3, 4)
    with _compat.guard_profile_skipped():
        out = torch.compile(two_inputs, backend="eager", fullgraph=True)(x, x, 5)
    torch.testing.assert_close(out, two_inputs(x, x, 5))
    assert returned == [0.0], "Dynamo times a trace's guards through the module's name"

    def other(x: torch.Tensor) -> torch.Tensor:
        return x * 3

    torch.testing.assert_close(torch.compile(other, backend="eager")(x), x * 3)
    assert len(returned) == 2 and returned[1] > 0.0, "outside tessera's traces Dynamo's own timing runs"


@pytest.mark.parametrize("abandoned", [True, False])
def test_a_guard_filter_that_raises_leaves_the_model_free_once_the_build_is_abandoned(abandoned):
    import gc
    import weakref

    class Stop(Exception):
        pass

    model = torch.nn.Linear(4, 4).requires_grad_(False)
    ref = weakref.ref(model)

    def forward(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x) * 2

    def refuse(entries: list[Any]) -> list[bool]:
        if abandoned:
            _compat.guard_build_abandoned()
        raise Stop

    compiled = torch.compile(forward, backend="eager", fullgraph=True, options={"guard_filter_fn": refuse})
    with pytest.raises(Exception) as raised:
        compiled(model, torch.randn(2, 4))
    assert Stop in {type(raised.value), type(raised.value.__cause__), type(raised.value.__context__)}
    del model, compiled, raised
    torch._dynamo.reset()
    gc.collect()
    # Without it, Dynamo's finalizer on the guarded model holds the guard builder, and that the model.
    assert (ref() is None) is abandoned


def test_fresh_inductor_cache_points_inductor_at_an_empty_directory(tmp_path):
    import os

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with _compat.fresh_inductor_cache(str(tmp_path)):
        inside = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert inside.startswith(str(tmp_path)) and os.listdir(inside) == []
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before


def test_trace_errors_and_constraint_violation_are_exception_types():
    errors = _compat.trace_errors()
    assert errors and all(issubclass(e, BaseException) for e in errors)

    def breaks(x: torch.Tensor) -> torch.Tensor:
        print("graph break")  # noqa: T201
        return x

    with pytest.raises(errors):
        traced(breaks, torch.randn(2))
    assert issubclass(_compat.constraint_violation_error(), BaseException)


def test_backend_failure_unwraps_what_the_backend_raised():
    class Ours(Exception):
        pass

    def failing(gm: Any, inputs: Any) -> Any:
        raise Ours("from the backend")

    with pytest.raises(Exception) as caught:
        torch.compile(lambda x: x + 1, backend=failing, fullgraph=True)(torch.randn(2))
    assert isinstance(_compat.backend_failure(caught.value), Ours)
    assert _compat.backend_failure(ValueError()) is None


# -- tensors, symbols, ops ---------------------------------------------------------------------------
def test_storage_identity():
    x = torch.randn(4, 3)
    assert _compat.same_storage(x, x[1:]) and not _compat.same_storage(x, x.clone())


def test_symbols_read_from_a_fake_graph():
    seen = traced(two_inputs, torch.randn(4, 3), torch.randn(4, 3), 2, mark=(0, 1))
    placeholder = next(n for n in seen["gm"].graph.nodes if n.op == "placeholder" and n.name == "l_x_")
    size = placeholder.meta["example_value"].shape[0]
    assert isinstance(size, torch.SymInt)
    assert _compat.sym_expr(size).is_Symbol and not _compat.is_constant_symint(size)
    assert _compat.size_hint(size) == 4 and _compat.size_hint(7) == 7


def test_a_plain_tensor_is_told_from_a_wrapper_subclass():
    class Wrapper(torch.Tensor):  # the shape of torchao's and DTensor's wrappers
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        def __init__(self, inner):
            self.inner = inner

        def __tensor_flatten__(self):
            return ["inner"], None

        @staticmethod
        def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
            return Wrapper(inner_tensors["inner"])

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    assert _compat.is_plain_tensor(torch.randn(2)) and _compat.is_plain_tensor(
        torch.nn.Parameter(torch.ones(1))
    )
    assert not _compat.is_plain_tensor(Wrapper(torch.randn(2))) and not _compat.is_plain_tensor(3)


def test_size_expressions_saved_as_text_read_back_with_torchs_own_functions():
    import sympy
    import torch.utils._sympy.functions as functions  # what a trace's strides are made of

    s0, s1 = sympy.symbols("s0 s1", integer=True, positive=True)
    expr = functions.FloorDiv(s0 * 3, 2) + functions.Mod(s1, 4)
    read = _compat.sympy_expression(str(expr))
    assert read.subs({sympy.Symbol("s0"): 10, sympy.Symbol("s1"): 7}) == 15 + 3


def test_op_names_and_mutability():
    op = torch.ops.aten.add_.Tensor
    assert isinstance(op, _compat.OpOverload)
    assert isinstance(torch.ops.aten.add, _compat.OpOverloadPacket)
    assert _compat.op_schema_name(op) == "aten::add_"
    assert _compat.overload_of(op) == "Tensor"
    assert _compat.op_overload_name(op) == "aten::add_.Tensor"
    assert _compat.op_is_mutable(op) and not _compat.op_is_mutable(torch.ops.aten.add.Tensor)
    assert _compat.packet_name(torch.ops.aten.add) == "aten::add"


# -- the global state a graph bakes in ---------------------------------------------------------------
def test_call_state_sees_autocast_default_dtype_and_function_modes():
    plain = _compat.call_state()
    assert plain == ((), torch.float32, 0)
    assert _compat.any_autocast()() is False and _compat.function_mode_depth()() == 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _compat.call_state()[0] == (("cpu", torch.bfloat16),)
        assert _compat.any_autocast()() is True
    with torch.device("cpu"):
        assert _compat.call_state()[2] == 1 == _compat.function_mode_depth()()
    assert _compat.call_state() == plain


def test_guard_globals_resolve_dynamos_aliases():
    namespace = _compat.guard_globals({})
    assert namespace["__import_torch_dot_nn"] is torch.nn
    assert "abs" in namespace["__builtins_dict___0"]
    with pytest.raises(KeyError):
        namespace["unknown"]


# -- saved bytecode: Dynamo's helpers without importing Dynamo ----------------------------------------
def test_the_dynamo_utils_helpers_match_dynamos_own():
    from torch._dynamo import utils

    x = torch.randn(4, 3)[1:]
    helpers = _compat.DYNAMO_UTILS_HELPERS
    for name in ("call_size", "call_stride"):
        assert helpers[name](x, 1) == getattr(utils, name)(x, 1)
    assert helpers["call_storage_offset"](x) == utils.call_storage_offset(x)
    for name in helpers:
        assert hasattr(utils, name), f"torch._dynamo.utils.{name} is gone: the saved bytecode's helper"
    cm = helpers["record_pregraph_bytecode_enter"]()
    helpers["record_pregraph_bytecode_exit"](cm)

    class Plain:
        pass

    obj = Plain()
    helpers["object_setattr_ignore_descriptor"](obj, "a", 1)
    assert obj.a == 1


def test_saved_bytecode_reads_only_known_helpers(tmp_path, monkeypatch):
    """A cold trace's bytecode, run warm: the helpers it reads from torch._dynamo.utils are ours."""
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path))
    x = torch.randn(4, 3)[:, :2]  # a strided input: the bytecode reads sizes and strides
    cold = tessera.compile(lambda t: t.sum(-1) * t.shape[0], backend="eager")
    with torch.no_grad():
        expected = cold(x)
    assert cold.trace_code is not None
    lazy = _compat.module_for_bytecode("torch._dynamo.utils")
    if isinstance(lazy, _compat.LazyModule):
        for name in cold.trace_code.co_names:
            assert not name.startswith("call_") or name in _compat.DYNAMO_UTILS_HELPERS
    torch.testing.assert_close(expected, x.sum(-1) * 4)


def test_module_for_bytecode_stands_in_for_dynamo_until_needed():
    import sys

    if "torch._dynamo.utils" in sys.modules:
        assert _compat.module_for_bytecode("torch._dynamo.utils") is sys.modules["torch._dynamo.utils"]
    lazy = _compat.LazyModule("torch._dynamo.utils", {"call_size": _compat.DYNAMO_UTILS_HELPERS["call_size"]})
    assert lazy.call_size(torch.randn(2, 5), 1) == 5
    assert callable(lazy.is_compile_supported)  # falls through to the real module
    assert _compat.module_for_bytecode("math").sqrt(4) == 2


# -- Inductor -------------------------------------------------------------------------------------
def test_inductor_config_reads():
    names = _compat.inductor_config_names()
    assert "max_autotune" in names and "cpp.simdlen" in names
    assert names >= _compat.INDUCTOR_CONFIG_NOT_IN_KEY
    first = _compat.inductor_config_repr()
    assert first == _compat.inductor_config_repr()
    before = _compat.inductor_config_overrides()
    with _compat.inductor_config().patch({"max_autotune": not _compat.inductor_config().max_autotune}):
        assert _compat.inductor_config_repr() != first
        assert _compat.inductor_config_overrides() != before


def test_vector_isa_reads():
    candidates = _compat.vec_isa_candidates()
    assert isinstance(candidates, tuple)
    picked = _compat.picked_vec_isa()
    assert isinstance(picked, str)
    with _compat.trusted_vec_isa(True):
        assert _compat.inductor_config().cpp.vec_isa_ok is True


def test_kernel_env_and_extern_kernels():
    env = _compat.kernel_env()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    assert hasattr(_compat.extern_kernels(), "mm")
    assert isinstance(_compat.custom_graph_pass_base(), type)


@pytest.mark.inductor
def test_standalone_compile_saves_loads_and_exposes_its_code(tmp_path):
    def f(x: torch.Tensor) -> tuple[torch.Tensor]:
        return ((x * 2).sin(),)  # as tessera's pieces: a sequence out

    x = torch.randn(8)
    gm = traced(f, x)["gm"]  # a Dynamo graph, as tessera compiles
    artifact = _compat.standalone_compile(gm, [x], "from_example_inputs", {})
    torch.testing.assert_close(artifact(x)[0], f(x)[0])
    assert _compat.find_compiled_graph(artifact) is not None
    path = str(tmp_path / "artifact.bin")
    artifact.save(path=path, format="binary")
    loaded = _compat.load_compiled_artifact(path)
    torch.testing.assert_close(loaded(x)[0], f(x)[0])


# -- module hooks, structured trace ---------------------------------------------------------------------
def test_module_hook_dicts():
    module = torch.nn.Linear(2, 2)
    assert _compat.global_module_hooks() is False and _compat.global_backward_hooks() is False
    assert not _compat.has_forward_hooks(module) and not _compat.has_backward_hooks(module)
    module.register_full_backward_hook(lambda m, grad_in, grad_out: None)
    assert _compat.has_backward_hooks(module) and not _compat.has_forward_hooks(module)
    module.register_forward_pre_hook(lambda m, args: None)
    assert _compat.has_forward_hooks(module)
    module.register_forward_hook(lambda m, args, kwargs, out: None, with_kwargs=True)
    pre, post, pre_kwargs, post_kwargs = _compat.forward_hooks(module)
    assert len(pre) == 1 and len(post) == 1 and not pre_kwargs and len(post_kwargs) == 1
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert _compat.global_module_hooks() is True
    finally:
        handle.remove()


def test_trace_artifact_is_silent_without_torch_trace():
    _compat.trace_artifact("tessera_test", lambda: "payload", in_compile=False)


def test_dynamos_clean_up_hooks_for_tesseras_entry_frames_are_dropped_and_others_kept():
    from torch._dynamo import utils

    if not hasattr(utils, "_cleanup_owners"):
        pytest.skip("this torch's clean-up hooks read no module global at exit (before 2.15)")
    x, y = torch.randn(3), torch.randn(3)
    ours, theirs = tessera.compile(two_inputs, backend="eager"), torch.compile(two_inputs, backend="eager")
    ours(x, y, 2), theirs(x, y, 2)  # theirs: the user's own, in this module's globals

    def scopes() -> set[str]:
        hooks = utils.CleanupManager.instance.values.values()
        return {hook.scope.get("__name__") for some in hooks for hook in some}

    assert {"tessera.trace.wrapper", __name__} <= scopes()
    _compat.keep_dynamo_names_at_exit("tessera.trace.wrapper")
    assert "tessera.trace.wrapper" not in scopes() and __name__ in scopes()


# -- the supported range -----------------------------------------------------------------------------
def test_the_installed_torch_is_in_the_tested_range_and_others_warn_once(monkeypatch):
    assert _compat.untested_torch() is None, torch.__version__
    assert _compat.torch_release("2.15.0+cu130") == (2, 15)
    assert _compat.untested_torch("2.11.0") is None
    assert "outside the range" in (_compat.untested_torch("2.16.0") or "")
    assert "outside the range" in (_compat.untested_torch("2.10.1") or "")
    from tessera import validation

    monkeypatch.setattr(torch, "__version__", "2.99.0")
    validation.warn_if_untested_torch.cache_clear()
    try:
        with pytest.warns(tessera.UntestedTorchWarning, match="2.99.0"):
            tessera.compile(two_inputs, backend="eager")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tessera.compile(two_inputs, backend="eager")  # once per process
    finally:
        validation.warn_if_untested_torch.cache_clear()


def test_a_hook_before_thread_joins_runs_before_a_running_thread_is_joined():
    # The thread ends only once the hook has run: an exit that joined it first would hang.
    script = """
import threading
from tessera import _compat
gate = threading.Event()
def work():
    gate.wait()
    print("released", flush=True)
threading.Thread(target=work).start()
_compat.before_thread_joins(gate.set)
"""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0 and "released" in proc.stdout, proc.stderr[-2000:]


def test_dynamos_compile_lock_is_found_and_reentrant():
    lock = _compat.dynamo_compile_lock()
    import torch._dynamo.convert_frame as convert_frame

    assert lock is convert_frame.compile_lock, "tessera's compiles must take the lock Dynamo takes"
    with lock, lock:  # re-entrant: a trace that compiles pieces takes it again inside Dynamo's
        pass


def test_the_fx_tracing_flag_is_per_thread_after_isolation():
    import threading

    import torch.fx._symbolic_trace as symbolic_trace

    _compat.isolate_fx_tracing_flag()
    readers = (symbolic_trace.is_fx_tracing, symbolic_trace.is_fx_symbolic_tracing)
    inside, finish, seen = threading.Event(), threading.Event(), []

    def traced(x):
        seen.append([reader() for reader in readers])  # in the tracing thread: tracing
        inside.set()
        finish.wait(30)
        return x

    thread = threading.Thread(target=torch.fx.symbolic_trace, args=(traced,))
    thread.start()
    try:
        assert inside.wait(30)
        assert [reader() for reader in readers] == [False, False], "another thread's trace"
    finally:
        finish.set()
        thread.join(30)
    assert seen == [[True, True]]


def test_a_background_thread_finds_the_device_guard_set_by_the_thread_that_started_it(monkeypatch):
    # torch 2.11's CUDA build without a GPU crashed when a background trace was the first to set
    # the no-op CUDA device guard (FakeTensorMode.__enter__): the starting thread sets it first.
    import threading

    from tessera.compilation.background import start_thread

    calls: list[int] = []
    monkeypatch.setattr(torch._C, "_ensureCUDADeviceGuardSet", lambda: calls.append(threading.get_ident()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _compat.settle_device_guards.cache_clear()
    try:
        seen: list[list[int]] = []
        start_thread("tessera-test", lambda: seen.append(list(calls))).join()  # type: ignore[union-attr]
        assert seen == [[threading.get_ident()]]  # set once, by the starter, before the thread ran
    finally:
        _compat.settle_device_guards.cache_clear()


def test_a_compile_in_a_thread_left_alone_keeps_the_draws_made_meanwhile():
    import threading

    from torch._dynamo import utils as dynamo_utils

    def compile_like(left_alone: bool) -> torch.Tensor:
        """A compile's save-and-restore around a draw the user's thread makes meanwhile."""
        drawn = threading.Event()
        resume = threading.Event()

        def compile_thread() -> None:
            alone = _compat.rng_left_alone() if left_alone else contextlib.nullcontext()
            with alone, dynamo_utils.preserve_rng_state():
                drawn.set()
                resume.wait(10)

        torch.manual_seed(7)
        thread = threading.Thread(target=compile_thread)
        thread.start()
        drawn.wait(10)
        first = torch.rand(3)  # the user's draw, while the compile runs
        resume.set()
        thread.join()
        return torch.cat([first, torch.rand(3)])

    torch.manual_seed(7)
    eager = torch.rand(6)
    assert torch.equal(compile_like(left_alone=True), eager)
    assert not torch.equal(compile_like(left_alone=False), eager)  # the stream repeats
    assert not _compat.rng_is_left_alone()


def _symbolic(mode: Any, *shape: int) -> torch.Tensor:
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * len(shape))
    return mode.from_tensor(torch.randn(*shape), symbolic_context=context)


def test_what_a_compile_assumes_of_the_sizes_after_the_trace_is_checked_per_call():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    x, other = _symbolic(mode, 3, 14), _symbolic(mode, 5, 7)
    length = x.shape[1]
    assert bool(x.shape[0] >= 2)  # a guard of the trace: its call check holds it
    _compat.note_trace([x, other])
    baseline = _compat.guard_baseline([x, length])
    assert _compat.compile_assumptions([x, length], baseline) is None  # nothing assumed yet
    # What Inductor asks of the sizes as it compiles (here asked by hand, at the hints):
    assert bool(x.shape[1] == 14)  # a size fixed (at a window's edge)
    assert bool(16 * x.shape[0] + 16 != 240)  # a relation relied on
    assert bool(other.shape[0] > 4)  # another piece's input: not this piece's assumption
    expression = _compat.compile_assumptions([x, length], baseline)
    assert expression is not None and "t1" in expression
    holds = _compat.guard_check(expression)
    assert holds((torch.randn(3, 14), 14))
    assert not holds((torch.randn(3, 15), 15))  # the size the compile fixed
    assert not holds((torch.randn(14, 14), 14))  # the relation
    assert holds((torch.randn(9, 14), 14))
    # A shape env made for one compile (a worker's) begins at its count then.
    fresh = FakeTensorMode(shape_env=ShapeEnv())
    y = _symbolic(fresh, 4, 4)
    assert bool(y.shape[0] == y.shape[1])
    start = _compat.guard_baseline([y])
    assert bool(y.shape[0] > 3)
    check = _compat.guard_check(_compat.compile_assumptions([y], start) or "True")
    assert check((torch.randn(4, 4),)) and not check((torch.randn(3, 3),))


_PATCHES_SCRIPT = """
import json, os, sys
import torch
import torch.fx._symbolic_trace as fx
import tessera
from tessera._compat import patches

def targets():
    import torch._dynamo.guards as guards, torch._dynamo.utils as utils
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator as inlining
    return {
        "Tracer.trace": fx.Tracer.__dict__.get("trace"),
        "is_fx_tracing": fx.is_fx_tracing.__code__,
        "patch_method": getattr(getattr(fx, "_Patcher", None), "patch_method", None),
        "is_compiling": torch.compiler.is_compiling.__code__,
        "session": getattr(torch.compiler, "_compile_session_context", None),
        "profile_guard_manager": getattr(guards, "profile_guard_manager", None),
        "preserve_rng_state": utils.preserve_rng_state,
        "get_globals": inlining.__dict__.get("get_globals_source_and_value"),
    }

before = targets()
torch.set_grad_enabled(False)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
x = torch.randn(3, 4)
compiled = tessera.compile(model, backend="eager", background_compile=False)
torch.testing.assert_close(compiled(x), model(x))
with tessera._compat.rng_left_alone():
    pass
used = patches.installed()
changed = sorted(k for k, v in targets().items() if v is not before[k])
patches.remove_all()
restored = sorted(k for k, v in targets().items() if v is not before[k])
os.environ[patches.OFF_ENV] = "1"  # the cases that need no patch, with none installed
plain = torch.nn.Linear(4, 2)
again = tessera.compile(plain, backend="eager", background_compile=False)
y = torch.randn(5, 4)
torch.testing.assert_close(again(y), plain(y))
print(json.dumps({"used": used, "changed": changed, "left": restored,
                  "after": patches.installed(), "registry": sorted(patches.REGISTRY)}))
"""


def test_every_patch_of_torch_is_in_the_registry_removable_and_the_rest_runs_without():
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tessera._compat import patches

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _PATCHES_SCRIPT],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["used"], "a compile installs the patches this torch needs"
    assert set(found["used"]) <= set(found["registry"]) == set(patches.REGISTRY)
    assert found["changed"], "what a patch replaces is seen replaced"
    assert found["left"] == [], f"left patched after remove_all: {found['left']}"
    assert found["after"] == [], "with the switch off, nothing is installed again"
    # Each patch says why, and the torch releases it is for; the docs list every one.
    process = (root / "docs" / "process.md").read_text()
    for entry in patches.REGISTRY.values():
        assert entry.why and entry.torch, entry.name
        assert f"`{entry.name}`" in process, f"docs/process.md does not list the patch {entry.name}"
