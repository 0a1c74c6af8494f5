"""Trust: no silent wrong result, no crash from the cache, no code from someone else's files.

Each case is set up for real where the machine allows it (a read-only bind mount, a small tmpfs,
files owned by a second uid) and asserts the outcome: correct output, one warning, nothing left.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tessera
from tessera.cache.entry import MODEL, CacheDamagedWarning
from tessera.cache.tools import clear, find_entries, prune, stray_temp_files, verify
from tessera.errors import CacheWarning, TesseraWarning
from tessera.models import toy_llama
from tessera.trace.call_check import InputMismatchError
from tests.child import run_module

ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0
OTHER_UID = 65534  # "nobody": the second user of the ownership tests


def run_toy(compiled, model, sizes=(3, 9)):
    with torch.no_grad():
        for n in sizes:
            ids, pos = toy_llama.example_inputs(n)
            torch.testing.assert_close(compiled(ids, pos), model(ids, pos))


def cache_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


@contextlib.contextmanager
def recorded() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def leftovers(root: Path) -> list[Path]:
    """Temp and scratch files anywhere under ``root`` (there must be none after a failure)."""
    if not root.exists():
        return []
    return [
        p
        for p in root.rglob(".*")
        if p.is_file() and (p.name.endswith(".tmp") or p.name.startswith(".piece"))
    ]


# -- calls that differ from the traced one --------------------------------------------------------
def forward_with_options(x, residual=None, alpha=1.0):
    y = x * alpha
    if residual is not None:
        y = y + residual
    return y


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (
            lambda c, x: c(x, residual=torch.ones_like(x)),
            "argument 'residual': the trace was made without it",
        ),
        (lambda c, x: c(x, alpha=2.0), "argument 'alpha': the trace was made without it"),
        (lambda c, x: c(x.to(torch.bfloat16)), "x: dtype: the trace assumed torch.float32"),
        (lambda c, x: c(x.to("meta")), "x: device"),
        (lambda c, x: c(torch.randn(4, 5)), "x: size of dim 1 (static): the trace assumed 3"),
        (lambda c, x: c(x[None]), "x: number of dims: the trace assumed 2"),
    ],
)
def test_a_call_unlike_the_first_is_refused_by_name(call, words):
    """With max_traces=1 (trace once) a call unlike the first is refused, naming the difference;
    by default it is traced again and equals eager."""
    compiled = tessera.compile(forward_with_options, backend="eager", max_traces=1)
    x = torch.randn(4, 3)
    torch.testing.assert_close(compiled(x), x)
    with pytest.raises(InputMismatchError, match=words.replace("(", r"\(").replace(")", r"\)")):
        call(compiled, x)
    if "meta" not in words and "device" not in words:
        retraced = tessera.compile(forward_with_options, backend="eager", disable_cache=True)
        before = tessera.counters.snapshot()["graphs_traced"]
        retraced(x)
        torch.manual_seed(0)  # the same arguments for both (some calls make random ones)
        expected = call(forward_with_options, x)
        torch.manual_seed(0)
        torch.testing.assert_close(call(retraced, x), expected)
        # Traced again (the first trace may be held back: the second, wider, serves its calls).
        assert tessera.counters.snapshot()["graphs_traced"] - before == 2
        assert words.split(":")[0] in retraced.traces[-1].reason
    assert isinstance(InputMismatchError("x"), tessera.TesseraError)
    # Calls like the first, in another syntax, still run (and give eager's numbers).
    torch.testing.assert_close(compiled(x, None, 1.0), x)
    torch.testing.assert_close(compiled(x=x, alpha=1.0), x)
    torch.testing.assert_close(compiled(torch.ones(6, 3)), torch.ones(6, 3))


def test_a_scalar_of_another_type_is_refused_even_when_equal():
    compiled = tessera.compile(forward_with_options, backend="eager", max_traces=1)
    x = torch.arange(6).reshape(2, 3)
    torch.testing.assert_close(compiled(x, alpha=2), x * 2)
    with pytest.raises(InputMismatchError, match="alpha: type: the trace assumed int, this call has float"):
        compiled(x, alpha=2.0)  # eager gives a float tensor here
    with pytest.raises(InputMismatchError, match="alpha: type: the trace assumed int, this call has bool"):
        compiled(x, alpha=True)
    torch.testing.assert_close(compiled(x, alpha=2), x * 2)


def test_first_call_with_the_keyword_then_without_is_refused():
    compiled = tessera.compile(forward_with_options, backend="eager", max_traces=1)
    x = torch.randn(4, 3)
    torch.testing.assert_close(compiled(x, residual=x, alpha=2.0), 3 * x)
    with pytest.raises(
        InputMismatchError, match="residual: type: the trace assumed Tensor, this call has NoneType"
    ):
        compiled(x, alpha=2.0)
    with pytest.raises(InputMismatchError, match=r"alpha: value: the trace assumed 2\.0"):
        compiled(x, residual=x, alpha=3.0)


@pytest.mark.inductor
def test_int32_token_ids_are_refused_before_any_kernel_runs():
    """Compiled kernels index with the traced dtype: int32 ids aborted the process before."""
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="inductor", disable_cache=True, max_traces=1)
    run_toy(compiled, model, sizes=(5,))
    ids, pos = toy_llama.example_inputs(7)
    with pytest.raises(InputMismatchError, match=r"input_ids: dtype: the trace assumed torch\.int64"):
        compiled(ids.to(torch.int32), pos)
    run_toy(compiled, model, sizes=(7,))


def test_check_inputs_false_is_the_raw_path():
    compiled = tessera.compile(forward_with_options, backend="eager", check_inputs=False)
    x = torch.randn(4, 3)
    compiled(x)
    assert compiled.call_spec is not None and compiled._life.call is compiled.traces[0].fast


# -- the model you pass is the model that runs ----------------------------------------------------
def test_root_forward_and_pre_hooks_change_the_output_as_in_eager():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager")
    run_toy(compiled, model)
    handle = model.register_forward_hook(lambda module, args, out: out * 2 + 1)
    run_toy(compiled, model)
    pre = model.register_forward_pre_hook(lambda module, args: (args[0].flip(0), args[1]))
    run_toy(compiled, model)
    handle.remove()
    pre.remove()
    run_toy(compiled, model)
    hooked = toy_llama.build(num_layers=1)  # a hook present from the first call on
    hooked.register_forward_hook(lambda module, args, kwargs, out: out - len(kwargs), with_kwargs=True)
    run_toy(tessera.compile(hooked, backend="eager"), hooked)


def test_root_hooks_run_once_on_the_first_call_of_a_warm_start(tmp_path):
    def hooked() -> torch.nn.Module:
        model = toy_llama.build(num_layers=1)
        model.register_forward_pre_hook(lambda module, args: (args[0].flip(0), args[1]))
        model.register_forward_hook(lambda module, args, out: out * 2 + 1)
        return model

    cold = hooked()
    run_toy(tessera.compile(cold, backend="eager", cache_dir=str(tmp_path)), cold)
    model = hooked()
    warm = tessera.compile(model, backend="eager", cache_dir=str(tmp_path))
    run_toy(warm, model)  # the first call of the two is the one the warm start serves
    assert warm.warm_start is True


def test_backward_hooks_are_refused_clearly():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager")
    run_toy(compiled, model)
    model.register_full_backward_hook(lambda *a: None)
    with pytest.raises(tessera.TesseraError, match="backward hooks"):
        compiled(*toy_llama.example_inputs(4))


@pytest.mark.parametrize("kind", ["sequential", "transformer_encoder"])
def test_modules_whose_forward_lives_in_torch_compile_and_match(kind):
    torch.manual_seed(0)
    if kind == "sequential":
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).eval()
        shapes = [(5, 8), (3, 8), (17, 8)]
    else:
        layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
        shapes = [(5, 6, 16), (3, 6, 16), (9, 6, 16)]
    compiled = tessera.compile(model, backend="eager")
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(shape)
            torch.testing.assert_close(compiled(x), model(x))
    assert tessera.counters.snapshot()["graphs_traced"] == 1


# -- the cache steps aside, loudly, once ----------------------------------------------------------
@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only for this process: a read-only bind mount as root, else no write bits."""
    if ROOT_USER:
        subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,ro,bind", str(path)], check=True)
            yield
        finally:
            subprocess.run(["umount", str(path)], check=True)
    else:
        modes = {p: p.stat().st_mode for p in [path, *path.rglob("*")]}
        for p, mode in modes.items():
            p.chmod(mode & ~0o222)
        try:
            yield
        finally:
            for p, mode in modes.items():
                p.chmod(mode)


@contextlib.contextmanager
def small_tmpfs(path: Path, kib: int) -> Iterator[Path]:
    if not ROOT_USER:
        pytest.skip("a full disk is simulated with a small tmpfs, which needs root to mount")
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0700", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        # Lazy: this process keeps the in-use markers of the entries it opened there.
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def test_a_file_in_the_way_of_the_root_steps_aside_once(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache root should be")
    model = toy_llama.build(num_layers=1)
    with recorded() as caught:
        compiled = tessera.compile(model, backend="eager", cache_dir=str(blocker / "cache"))
        run_toy(compiled, model)
    assert len(cache_warnings(caught)) == 1, cache_warnings(caught)
    assert str(blocker) in cache_warnings(caught)[0] and compiled.cache_dir is None


def test_a_read_only_root_compiles_without_the_cache_once_warned(tmp_path):
    root = tmp_path / "ro-root"
    root.mkdir(mode=0o700)
    model = toy_llama.build(num_layers=1)
    with read_only(root), recorded() as caught:
        compiled = tessera.compile(model, backend="eager", cache_dir=str(root))
        run_toy(compiled, model)
    messages = cache_warnings(caught)
    assert len(messages) == 1 and "compiling without the cache" in messages[0], messages
    assert not list(root.iterdir())


def test_a_warm_cache_on_a_read_only_mount_still_loads(tmp_path):
    root = tmp_path / "baked"
    model = toy_llama.build(num_layers=2)
    run_toy(tessera.compile(model, backend="eager", cache_dir=str(root)), model)
    tessera.counters.reset()
    with read_only(root), recorded() as caught:
        warm = tessera.compile(model, backend="eager", cache_dir=str(root))
        run_toy(warm, model)
    assert warm.warm_start is True and tessera.counters.snapshot()["graphs_traced"] == 0
    messages = cache_warnings(caught)
    assert len(messages) == 1 and "read-only" in messages[0], messages


@pytest.mark.inductor
def test_disk_full_while_saving_pieces_runs_from_memory_and_leaves_nothing(tmp_path):
    model = toy_llama.build(num_layers=2)
    with small_tmpfs(tmp_path / "full", kib=96) as root, recorded() as caught:
        compiled = tessera.compile(model, backend="inductor", cache_dir=str(root))
        run_toy(compiled, model)
        assert leftovers(root) == []
    messages = cache_warnings(caught)
    assert len(messages) == 1 and "No space left on device" in messages[0], messages


def test_disk_full_while_saving_the_whole_model_artifact(tmp_path, monkeypatch):
    from tessera.trace import model_artifact as artifact

    real = artifact.dumps
    monkeypatch.setattr(artifact, "dumps", lambda saved: real(saved) + b"\0" * (2 << 20))  # 2 MiB more
    model = toy_llama.build(num_layers=1)
    with small_tmpfs(tmp_path / "full", kib=1024) as root, recorded() as caught:
        compiled = tessera.compile(model, backend="eager", cache_dir=str(root))
        run_toy(compiled, model)
        assert leftovers(root) == [] and not (compiled.cache_dir / MODEL).exists()
        run_toy(compiled, model, sizes=(5, 11))  # the model stays usable in this process
    messages = cache_warnings(caught)
    assert len(messages) == 1 and "No space left on device" in messages[0], messages


def _toy_process(root: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """A separate process runs the toy model (this one must not hold the entry in use)."""
    return run_module(
        "tests.run_toy", str(out), "--backend", "eager", "--layers", "1", cache=root, timeout=300
    )


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_prune_and_clear_remove_pointers_and_stray_temp_files(tmp_path):
    root = tmp_path / "cache"
    _toy_process(root, tmp_path / "a.pt")
    (entry,) = find_entries(root)
    assert len(list((root / "warm").glob("*.json"))) == 1
    stray = entry / f".index.py.{_dead_pid()}.abcd1234.tmp"
    stray.write_bytes(b"half a write")
    live = entry / f".index.py.{os.getpid()}.abcd1234.tmp"  # a writer that is still running
    live.write_bytes(b"in progress")
    assert stray_temp_files(root) == [stray]
    assert clear(root) == 1 and not stray.exists() and not entry.exists()
    assert not list((root / "warm").glob("*.json"))  # the pointer went with its entry
    proc = _toy_process(root, tmp_path / "b.pt")  # a plain miss: no damage, no warning
    assert "Warning" not in proc.stderr, proc.stderr[-2000:]
    assert len(prune(root, 0)) == 1 and find_entries(root) == []
    assert not list((root / "warm").glob("*.json"))


def test_verify_catches_a_damaged_whole_model_artifact(tmp_path):
    root = tmp_path / "cache"
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager", cache_dir=str(root))
    run_toy(compiled, model)
    assert verify(root) == []
    artifact = compiled.cache_dir / MODEL
    artifact.write_bytes(artifact.read_bytes()[:-10] + b"0123456789")
    problems = verify(root)
    assert len(problems) == 1 and MODEL in problems[0] and "checksum" in problems[0]
    with pytest.warns(CacheDamagedWarning, match=MODEL):
        run_toy(tessera.compile(model, backend="eager", cache_dir=str(root)), model)


# -- only your own files are trusted --------------------------------------------------------------
class _Planted:
    """Unpickling this runs code: it touches a marker file (what an attacker's pickle would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _plant(entry: Path, marker: Path) -> None:
    """Replace the entry's whole-model artifact by a malicious pickle with a matching checksum."""
    import hashlib

    from tessera.cache import index

    data = pickle.dumps(_Planted(str(marker)))
    (entry / MODEL).write_bytes(data)
    parsed = index.parse((entry / "index.py").read_text())
    parsed.model = index.FileRecord(MODEL, hashlib.sha256(data).hexdigest(), len(data))
    (entry / "index.py").write_text(parsed.format())


@pytest.mark.skipif(not ROOT_USER, reason="chown to a second uid needs root")
@pytest.mark.parametrize("how", ["entry owned by another uid", "group-writable root", "world-writable root"])
def test_a_planted_pickle_in_an_untrusted_entry_is_never_loaded(tmp_path, how):
    root = tmp_path / "cache"
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager", cache_dir=str(root))
    run_toy(compiled, model)
    entry, marker = compiled.cache_dir, tmp_path / "pwned"
    _plant(entry, marker)
    if how == "entry owned by another uid":
        for path in [entry, *entry.rglob("*")]:
            os.chown(path, OTHER_UID, OTHER_UID)
    else:
        root.chmod(0o770 if how == "group-writable root" else 0o777)
    tessera.counters.reset()
    with recorded() as caught:
        again = tessera.compile(model, backend="eager", cache_dir=str(root))
        run_toy(again, model)
    assert not marker.exists()  # the pickle was never unpickled
    assert again.warm_start is False and tessera.counters.snapshot()["graphs_traced"] == 1
    messages = cache_warnings(caught)
    assert len(messages) == 1 and ("owned by uid" in messages[0] or "writable by" in messages[0]), messages
    assert any("not trusted" in p for p in verify(root))


@pytest.mark.skipif(not ROOT_USER, reason="chown to a second uid needs root")
def test_a_group_shared_cache_is_trusted_only_when_opted_in(tmp_path, monkeypatch):
    root = tmp_path / "fleet"
    model = toy_llama.build(num_layers=1)
    monkeypatch.setenv("TESSERA_CACHE_SHARED", "group")
    compiled = tessera.compile(model, backend="eager", cache_dir=str(root))
    run_toy(compiled, model)
    entry = compiled.cache_dir
    assert entry.stat().st_mode & 0o7777 == 0o2770
    assert (entry / "index.py").stat().st_mode & 0o777 == 0o660
    for path in [entry, *entry.rglob("*")]:  # another member of the group wrote it
        os.chown(path, OTHER_UID, os.getgid())
    tessera.counters.reset()
    with recorded() as caught:
        warm = tessera.compile(model, backend="eager", cache_dir=str(root))
        run_toy(warm, model)
    assert warm.warm_start is True and not cache_warnings(caught)
    monkeypatch.delenv("TESSERA_CACHE_SHARED")
    with recorded() as caught:
        private = tessera.compile(model, backend="eager", cache_dir=str(root))
        run_toy(private, model)
    assert private.warm_start is False and len(cache_warnings(caught)) == 1


def test_new_entries_are_private(tmp_path):
    root = tmp_path / "cache"
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager", cache_dir=str(root))
    run_toy(compiled, model)
    entry = compiled.cache_dir
    for directory in (root, entry, entry / "artifacts"):
        assert directory.stat().st_mode & 0o077 == 0, oct(directory.stat().st_mode)
    for file in (entry / "index.py", entry / MODEL):
        assert file.stat().st_mode & 0o077 == 0, oct(file.stat().st_mode)
    shutil.rmtree(root)


# -- config mistakes surface at compile time ------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"backend": None}, "backend=None is unknown"),
        ({"compile_sizes": 16}, "compile_sizes=16 must be a list of integers"),
        ({"inductor_config": "x"}, "inductor_config='x' must map"),
        ({"dynamic_dims": {"ids": "0"}}, r"dynamic_dims\['ids'\]='0' must be an int"),
        ({"splitting_ops": "aten::foo"}, "splitting_ops='aten::foo' must be a list"),
        ({"disable_cache": "no"}, "disable_cache='no' must be True or False"),
        ({"max_size": True}, "max_size=True must be a positive integer"),
        ({"inductor_config": {"no_such_setting": 1}}, "unknown Inductor setting"),
        ({"mode": "fast"}, "mode='fast' is unknown"),
        ({"check_inputs": 1}, "check_inputs=1 must be True or False"),
        ({"dynamic_dims": {"tokens": 0}}, "dynamic_dims names"),
        ({"prefix": "a/b"}, "prefix='a/b' must be a plain directory name"),
    ],
)
def test_bad_config_values_raise_config_error_at_compile_time(overrides, words):
    with pytest.raises(tessera.ConfigError, match=words):
        tessera.compile(toy_llama.build(num_layers=1), **overrides)


def test_bad_environment_values_name_the_variable(monkeypatch):
    monkeypatch.setenv("TESSERA_DISABLE_CACHE", "maybe")
    with pytest.raises(tessera.ConfigError, match="TESSERA_DISABLE_CACHE='maybe'"):
        tessera.CompileConfig()
    monkeypatch.delenv("TESSERA_DISABLE_CACHE")
    monkeypatch.setenv("TESSERA_MODE", "fast")
    with pytest.raises(tessera.ConfigError, match="TESSERA_MODE='fast'"):
        tessera.CompileConfig()


def test_a_splitting_op_that_matches_nothing_warns_by_name():
    compiled = tessera.compile(toy_llama.build(num_layers=1), backend="eager", splitting_ops=["nosuch::op"])
    with pytest.warns(TesseraWarning, match="'nosuch::op' matches no call"):
        compiled(*toy_llama.example_inputs(4))
    assert len(compiled.pieces) == 1
