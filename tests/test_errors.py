"""Errors in the caller's terms: a call eager rejects raises eager's own error, an argument tessera
cannot take is named, and nothing but tessera's own warnings reaches stderr."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings

import pytest
import torch

import tessera
from tessera import _compat
from tessera.cache.blobstore import fault, fault_summary, warn_fault
from tessera.errors import CacheWarning, TesseraError, UnsupportedArgumentError, UnsupportedModelError
from tessera.trace import call_check
from tests.child import ROOT, child_env

EAGER_SHAPES = "mat1 and mat2 shapes cannot be multiplied"


class Projection(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def eager_error(model, *args) -> BaseException:
    try:
        model(*args)
    except Exception as e:
        return e
    raise AssertionError("eager took the call")


# -- a call eager rejects ----------------------------------------------------------------------------
def test_a_wrong_feature_size_on_the_first_call_raises_eagers_own_error():
    model = Projection().eval()
    compiled = tessera.compile(model, backend="eager")
    bad = torch.randn(4, 16)
    with torch.no_grad():
        expected = eager_error(model, bad)
        with pytest.raises(RuntimeError, match=EAGER_SHAPES) as caught:
            compiled(bad)
        # Eager's own exception (not Dynamo's TorchRuntimeError about fake tensors), the failed
        # trace kept as its context but not printed.
        assert type(caught.value) is type(expected) and str(caught.value) == str(expected)
        assert caught.value.__context__ is not None and caught.value.__suppress_context__
        x = torch.randn(4, 32)
        torch.testing.assert_close(compiled(x), model(x))  # the next call is the first trace
    assert len(compiled.traces) == 1


def test_a_wrong_feature_size_on_a_later_call_raises_eagers_error_and_changes_nothing():
    model = Projection().eval()
    compiled = tessera.compile(model, backend="eager")
    with torch.no_grad():
        compiled(torch.randn(4, 32))
        plan = compiled._traces.plan
        with pytest.raises(RuntimeError, match=EAGER_SHAPES):
            compiled(torch.randn(4, 16))
        assert compiled._traces.plan == plan  # the bad call made no dim dynamic
        x = torch.randn(3, 32)
        torch.testing.assert_close(compiled(x), model(x))
    assert len(compiled.traces) == 1


class MatMul(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class Flatten(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1) * 2


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize(
    ("model", "error", "words"),
    [
        (MatMul, TypeError, r"unsupported operand type\(s\) for @: 'NoneType'"),  # an op on fake tensors
        (Flatten, AttributeError, "'NoneType' object has no attribute 'view'"),  # the code raised
    ],
)
def test_none_for_a_tensor_raises_eagers_error_not_a_model_error(model, error, words, fullgraph):
    module = model()
    compiled = tessera.compile(module, backend="eager", fullgraph=fullgraph)
    with torch.no_grad():
        with pytest.raises(error, match=words) as caught:
            compiled(None)
        assert not isinstance(caught.value, TesseraError)
        x = torch.randn(4, 4)
        torch.testing.assert_close(compiled(x), module(x))
    # One graph: the bad call sent the model down no graph-break path (nor recorded one for the
    # next process).
    assert len(compiled.traces) == 1


# -- an argument tessera cannot take ----------------------------------------------------------------
def summed(x: torch.Tensor, values) -> torch.Tensor:
    return x + sum(values)


def test_an_argument_tessera_cannot_take_is_named():
    compiled = tessera.compile(summed, backend="eager", fullgraph=True)
    x = torch.ones(3)
    with torch.no_grad(), pytest.raises(UnsupportedArgumentError, match="argument 'values'") as caught:
        compiled(x, (v for v in range(3)))  # eager takes a generator; Dynamo cannot trace it
    assert caught.value.argument == "values"
    assert "builtins.generator" in str(caught.value) and "sum(values)" in str(caught.value)
    assert isinstance(caught.value, UnsupportedModelError) and caught.value.dynamo_error is not None


def branchy(x: torch.Tensor, flag: bool) -> torch.Tensor:
    return x if flag and x.sum() > 0 else -x


def test_a_data_dependent_branch_blames_no_argument():
    compiled = tessera.compile(branchy, backend="eager", fullgraph=True)
    with torch.no_grad(), pytest.raises(UnsupportedModelError) as caught:
        compiled(torch.ones(3), True)
    assert not isinstance(caught.value, UnsupportedArgumentError)


# -- nothing on stderr --------------------------------------------------------------------------------
CHILD = """
import torch, tessera
w = torch.randn(64, 64)

def flat(x):
    return x.reshape(x.shape[0], -1) @ w

# Dim 1 dynamic and 1 here: the size-oblivious trace fails in a meta kernel (64*s1 vs 64) and is
# traced again for this size; then a call eager rejects: its trace fails twice, eager's error.
compiled = tessera.compile(flat, backend="eager", dynamic_dims={"x": (0, 1)})
linear = tessera.compile(torch.nn.Linear(32, 8), backend="eager")
with torch.no_grad():
    x = torch.randn(2, 1, 64)
    torch.testing.assert_close(compiled(x), flat(x))
    for model, bad in ((compiled, torch.randn(2, 1, 32)), (linear, torch.randn(4, 16))):
        try:
            model(bad)
        except RuntimeError as e:
            assert "cannot be multiplied" in str(e), e
        else:
            raise AssertionError("the bad call ran")
print(tessera.counters.snapshot()["graphs_traced"])
"""


def test_a_failed_and_retried_trace_writes_nothing_to_stderr(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        env=child_env(tmp_path / "cache"),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["1"]  # the retried trace served the good call
    assert proc.stderr == ""  # before: ~200 lines of fake_tensor's "failed while attempting to run meta"


def test_torchs_log_lines_about_a_handled_trace_failure_go_to_debug_only():
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler, level = Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)  # as TORCH_LOGS="+fake_tensor" would
    try:
        with _compat.trace_failure_logs_quiet():
            logger.error("failed while attempting to run meta for %s", "aten.mm.default")
            logger.error("something else")
            logger.debug("failed while attempting to run meta for %s (asked for)", "aten.mm.default")
        logger.error("failed while attempting to run meta for %s", "after the trace")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == [
        "something else",
        "failed while attempting to run meta for aten.mm.default (asked for)",
        "failed while attempting to run meta for after the trace",
    ]
    assert not logger.filters


# -- the call check ----------------------------------------------------------------------------------
def pick(x: torch.Tensor, mask) -> torch.Tensor:
    if isinstance(mask, dict):
        mask = mask["full_attention"]
    return x * mask


def test_a_tensor_where_the_trace_saw_a_dict_is_checked_without_a_warning():
    """Qwen2 passes a mask per attention type (a dict) to one call and a tensor to another: the
    check of a dict's entries indexed the tensor with a string, and torch warned ("Using a
    non-tuple sequence for multidimensional indexing") from the generated code."""
    compiled = tessera.compile(pick, backend="eager")
    x = torch.randn(4, 4)
    masks = [{"full_attention": torch.ones(4, 4)}, torch.ones(4, 4), {"full_attention": torch.ones(4, 4)}]
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mask in [*masks, *masks]:
            torch.testing.assert_close(compiled(x, mask), pick(x, mask))
    assert [str(w.message) for w in caught] == []
    assert len(compiled.traces) == 2


def test_the_check_compares_a_dicts_entries_after_its_keys():
    spec = call_check.record(
        (torch.ones(2),), {"mask": {"full": torch.ones(2)}}, lambda path: path, lambda path: frozenset()
    )
    bound = spec.bind(None, {})
    accepts = call_check.make_predicate(spec, bound)
    read = call_check.tensor_reader(spec, bound)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:  # the check wants no grad
        warnings.simplefilter("always")
        assert accepts((torch.ones(2),), {"mask": {"full": torch.ones(2)}})
        assert not accepts((torch.ones(2),), {"mask": torch.ones(2)})
        assert not accepts((torch.ones(2),), {"mask": {"full": torch.ones(3)}})
        found = spec.mismatches((torch.ones(2),), {"mask": torch.ones(2)}, bound)
        assert len(read((torch.ones(2),), {"mask": torch.ones(2)})) == 1  # the dict's entry: none
        with pytest.raises(TypeError, match="a tensor, not a dict"):
            call_check.read_path("kwargs['mask']['full']", (), {"mask": torch.ones(2)})
    assert caught == []
    assert found and found[0][0].expr == "tuple(kwargs['mask'])"


def test_the_assumptions_are_read_until_the_caller_has_its_answer():
    # A call of a size no trace covers is searched against every entry's assumptions (hundreds
    # each): only layouts can be put right, so the first other broken one ends the search.
    spec = call_check.record(
        (torch.ones(2, 3), torch.ones(4)), {}, lambda path: path, lambda path: frozenset()
    )
    bound = spec.bind(None, {})
    call = ((torch.ones(5, 3), torch.ones(6)), {})
    every = spec.mismatches(*call, bound)
    first = spec.mismatches(*call, bound, until=lambda assumption: True)
    assert len(every) > 1 and first == every[:1]
    assert spec.mismatches((torch.ones(2, 3), torch.ones(4)), {}, bound, until=lambda a: True) == []


# -- object-store warnings ------------------------------------------------------------------------------
OBSTORE_ERROR = """Generic S3 error: Error performing GET http://127.0.0.1:9/bucket/tessera/v1/warm/831f in \
1.02s, after 9 retries, max_retries: 64, retry_timeout: 1s  - HTTP error: error sending request

Debug source:
Generic {
    store: "S3",
    source: RetryError(
        RetryErrorImpl {
            method: GET,
            retries: 9,
            inner: Http(
                HttpError {
                    kind: Connect,
                    source: ConnectError(
                        "tcp connect error",
                        Os {
                            code: 111,
                            kind: ConnectionRefused,
                            message: "Connection refused",
                        },
                    ),
                },
            ),
        },
    ),
}"""


class GenericError(Exception):
    """Stands in for obstore's exception of that name (its message is a multi-line debug dump)."""


def test_an_object_store_fault_is_one_line_in_its_warning_and_whole_at_debug(caplog):
    line = fault_summary(GenericError(OBSTORE_ERROR))
    assert "\n" not in line and "Debug source" not in line and len(line) <= 300 + len("GenericError: ")
    assert line.startswith("GenericError: Generic S3 error: Error performing GET http://127.0.0.1:9/")
    assert line.endswith("error sending request (Connection refused)")
    assert fault_summary(TimeoutError()) == "TimeoutError"
    assert fault_summary(OSError("one line")) == "OSError: one line"
    with caplog.at_level(logging.DEBUG, logger="tessera.cache.blobstore"):
        what = fault("s3://test-one-line", "fetching a pointer", GenericError(OBSTORE_ERROR))
    assert what == f"fetching a pointer failed ({line})"
    assert any("Debug source:" in r.getMessage() for r in caplog.records)  # the whole dump, at DEBUG
    with pytest.warns(CacheWarning) as warned:
        warn_fault("s3://test-one-line", what, "using the local cache only")
    assert len(warned) == 1 and "\n" not in str(warned[0].message)
