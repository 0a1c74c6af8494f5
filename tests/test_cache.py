"""The persistent cache: warm starts, self-healing, key sensitivity and the switch."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tessera
from tessera.cache import tools
from tessera.cache.entry import GRAPH, INDEX, CacheDamagedWarning, CacheEntry
from tessera.cache.explain import explain
from tessera.cache.tools import find_entries, verify
from tessera.errors import CacheWarning
from tessera.models import toy_llama
from tests.child import ROOT, child_env, run_toy

SIZES = (3, 9)


def compile_and_check(layers: int = 1, backend: str = "inductor", **overrides):
    model = toy_llama.build(num_layers=layers)
    compiled = tessera.compile(model, backend=backend, **overrides)
    outputs = []
    with torch.no_grad():
        for n in SIZES:
            ids, pos = toy_llama.example_inputs(n)
            outputs.append(compiled(ids, pos))
            torch.testing.assert_close(outputs[-1], model(ids, pos))
    return compiled, outputs


def fresh_counts(**overrides):
    tessera.counters.reset()
    compiled, outputs = compile_and_check(**overrides)
    return compiled, outputs, tessera.counters.snapshot()


@pytest.mark.inductor
def test_warm_start_loads_every_artifact_and_matches_exactly():
    cold, cold_out, counts = fresh_counts(compile_sizes=[3])
    assert counts["cache_misses"] == counts["backend_compilations"] == 4
    assert counts["artifacts_saved"] == 4
    warm, warm_out, counts = fresh_counts(compile_sizes=[3])
    assert counts["inductor_compiles"] == 0
    assert counts["graphs_traced"] == 0  # rebuilt from the whole-model artifact: no Dynamo
    assert counts["pieces"] == 3 and counts["compiled_pieces"] == 2
    assert counts["cache_hits"] == counts["backend_compilations"] == 4
    assert warm.cache_dir == cold.cache_dir
    for a, b in zip(cold_out, warm_out, strict=True):
        assert torch.equal(a, b)


def _damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 3)])
    else:
        path.write_bytes(os.urandom(max(64, path.stat().st_size)))


# Inductor where the file holds or points at compiled code (the index, the whole-model artifact,
# an artifact); the eager compiler for the files every backend writes alike (for CI's time: each
# Inductor case costs about 15 s of it).
@pytest.mark.parametrize("how", ["truncate", "random", "delete"])
@pytest.mark.parametrize(
    ("which", "backend"),
    [
        pytest.param("index.py", "inductor", marks=pytest.mark.inductor),
        ("cache_key_factors.json", "eager"),
        ("computation_graph.py", "eager"),
        pytest.param("model_artifact.pkl", "inductor", marks=pytest.mark.inductor),
        pytest.param("artifact", "inductor", marks=pytest.mark.inductor),
        ("source", "eager"),
    ],
)
def test_damaged_file_is_reported_once_rebuilt_and_then_hits(which, backend, how):
    first, _, _ = fresh_counts(backend=backend)
    entry = first.cache_dir
    if which == "artifact":
        target = sorted((entry / "artifacts").glob("*.bin"))[0]
    elif which == "source":
        (target,) = (entry / "sources").glob("toy_llama.py@*")
    else:
        target = entry / which
    _damage(target, how)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, counts = fresh_counts(backend=backend)  # outputs are checked against eager inside
    damage = [w for w in caught if issubclass(w.category, CacheDamagedWarning)]
    assert len(damage) == 1, [str(w.message) for w in damage]
    assert target.name in str(damage[0].message)
    if which in ("index.py", "artifact"):
        assert counts["inductor_compiles"] >= 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, counts = fresh_counts(backend=backend)
    assert not [w for w in caught if issubclass(w.category, CacheDamagedWarning)]
    assert counts["inductor_compiles"] == counts["eager_compiles"] == counts["graphs_traced"] == 0
    assert counts["cache_hits"] == counts["backend_compilations"]
    assert verify(entry.parents[2]) == []


@pytest.mark.inductor
def test_cache_root_moved_and_working_directory_changed_still_hit(tmp_path, monkeypatch):
    first, _, _ = fresh_counts()
    moved = tmp_path / "moved-root"
    shutil.copytree(first.cache_dir.parents[2], moved)
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(moved))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SOME_UNRELATED_VARIABLE", "1")
    second, _, counts = fresh_counts()
    assert second.cache_dir is not None and second.cache_dir.is_relative_to(moved)
    assert counts["inductor_compiles"] == 0 and counts["cache_hits"] == counts["backend_compilations"]


def test_config_field_that_changes_code_misses_and_explain_names_it():
    first, _, _ = fresh_counts(backend="eager")
    second, _, _ = fresh_counts(backend="eager", compile_ranges=[4])
    assert first.cache_dir != second.cache_dir
    lines = explain(first.cache_dir.parents[2], second.cache_dir)
    assert any("config field compile_ranges: [] -> [4]" in line for line in lines), lines


def test_torch_version_factor_misses_and_explain_names_it(monkeypatch):
    first, _, _ = fresh_counts(backend="eager")
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    second, _, _ = fresh_counts(backend="eager")
    assert first.cache_dir != second.cache_dir
    lines = explain(first.cache_dir.parents[2])
    assert any(line.strip().startswith("- torch version:") and "9.9.9" in line for line in lines), lines


def test_unrelated_config_and_environment_changes_hit(monkeypatch):
    first, _, _ = fresh_counts(backend="eager")
    monkeypatch.setenv("TESSERA_DISABLE_CACHE_UNRELATED", "x")
    monkeypatch.setenv("OMP_SCHEDULE", "static")
    second, _, _ = fresh_counts(backend="eager")
    assert first.cache_dir == second.cache_dir


def test_disable_cache_reads_and_writes_nothing(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    compiled, _, counts = fresh_counts(backend="eager", disable_cache=True)
    assert compiled.cache_dir is None and not root.exists()
    monkeypatch.setenv("TESSERA_DISABLE_CACHE", "1")
    compiled, _, _ = fresh_counts(backend="eager")
    assert compiled.cache_dir is None and not root.exists()
    assert counts["cache_hits"] == counts["cache_misses"] == 0


def test_index_is_literal_only_and_never_executed(tmp_path):
    first, _, _ = fresh_counts(backend="eager")
    entry = first.cache_dir
    marker = tmp_path / "pwned"
    (entry / INDEX).write_text(f"__import__('pathlib').Path({str(marker)!r}).touch()\n")
    with pytest.warns(CacheDamagedWarning, match=INDEX):
        fresh_counts(backend="eager")
    assert not marker.exists()


def test_layout_holds_factors_graph_and_index(tmp_path):
    compiled, _, _ = fresh_counts(backend="eager", prefix="backbone")
    entry = compiled.cache_dir
    assert entry.name == "backbone" and entry.parent.name == "rank_0_0"
    assert entry.parents[2] == tmp_path / "cache"
    assert (entry / "cache_key_factors.json").exists()
    assert "submod_0" in (entry / "computation_graph.py").read_text()
    assert find_entries(tmp_path / "cache") == [entry]


def test_a_changed_module_constant_is_never_a_false_hit():
    """Same code, same parameter shapes, another eps: the traced graph differs, so must the entry."""
    first, _, _ = fresh_counts(backend="eager")
    tessera.counters.reset()
    model = toy_llama.build(num_layers=1, eps=0.5)
    compiled = tessera.compile(model, backend="eager")
    ids, pos = toy_llama.example_inputs(5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    assert tessera.counters.snapshot()["graphs_traced"] == 1
    assert compiled.cache_dir != first.cache_dir


@pytest.mark.inductor
def test_damaged_warm_pointer_is_reported_and_rebuilt():
    first, _, _ = fresh_counts()
    (pointer,) = (first.cache_dir.parents[2] / "warm").glob("*.json")
    pointer.write_bytes(b"\x00garbage")
    with pytest.warns(CacheDamagedWarning, match=pointer.name):
        fresh_counts()
    _, _, counts = fresh_counts()
    assert counts["graphs_traced"] == 0


def test_a_file_the_index_does_not_vouch_for_yet_is_not_damage(tmp_path):
    """Another process may be creating the entry: its not-yet-written files are no damage."""
    from tessera.cache.entry import GRAPH, CacheEntry

    root, factors = tmp_path / "root", {"factor": 1}
    path = CacheEntry.create(root, "model", factors, "graph v1", []).path
    half_made = CacheEntry(path, factors, "key")
    half_made._load_index()
    half_made.index.files.pop(GRAPH)  # as if the creating process had not recorded it yet
    half_made._write_index()
    (path / GRAPH).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheDamagedWarning)
        CacheEntry.create(root, "model", factors, "graph v1", [])
    assert (path / GRAPH).read_text() == "graph v1"
    (path / GRAPH).write_text("tampered")  # now the index vouches for it: damage
    with pytest.warns(CacheDamagedWarning, match=GRAPH):
        CacheEntry.create(root, "model", factors, "graph v1", [])


def _count_index_writes(monkeypatch) -> list[Path]:
    """Every write of an entry's index file from now on (all go through entry.atomic_write)."""
    from tessera.cache import entry

    writes: list[Path] = []
    real = entry.atomic_write

    def counting(path: Path, data: bytes) -> None:
        if path.name == INDEX:
            writes.append(path)
        real(path, data)

    monkeypatch.setattr(entry, "atomic_write", counting)
    return writes


def test_index_writes_per_cold_start_do_not_grow_with_identical_layers(monkeypatch):
    """Linking identical layers, recording pieces and source snapshots are batched: one write when
    the entry is opened, one per compile turn, one with the whole-model artifact."""
    writes = _count_index_writes(monkeypatch)
    per_model = {}
    for layers in (1, 8):
        writes.clear()
        torch._dynamo.reset()
        tessera.counters.reset()
        compiled, _ = compile_and_check(layers=layers, backend="eager")
        assert compiled.report is not None
        shared = sum(a.source == "shared" for a in compiled.report.artifacts)
        # The pieces between two attentions are identical: all but the first are links.
        assert shared == max(0, layers - 2)
        assert set(writes) == {compiled.cache_dir / INDEX}
        per_model[layers] = len(writes)
    assert per_model == {1: 3, 8: 3}

    writes.clear()
    torch._dynamo.reset()
    tessera.counters.reset()
    warm, _ = compile_and_check(layers=8, backend="eager")
    assert warm.warm_start is True and writes == []  # the index recorded every piece and link


# -- prune and clear against processes using the entry -------------------------------------------
@contextlib.contextmanager
def paused_pruner(root: Path, monkeypatch) -> Iterator[tuple[threading.Thread, threading.Event, list[Path]]]:
    """``prune(root, 0)`` in a thread, held where it has locked an unused entry to remove it until
    the test sets the event it yields; the list gets what it removed."""
    holding, go, removed = threading.Event(), threading.Event(), []
    real = tools.exclusive_if_unused

    @contextlib.contextmanager
    def held_when_free(path: Path) -> Iterator[bool]:
        with real(path) as free:
            if free:
                holding.set()
                assert go.wait(60), "the test never let the pruner go on"
            yield free

    monkeypatch.setattr(tools, "exclusive_if_unused", held_when_free)
    pruner = threading.Thread(target=lambda: removed.extend(tools.prune(root, 0)))
    pruner.start()
    try:
        assert holding.wait(60), "the pruner found nothing to remove"
        yield pruner, go, removed
    finally:
        go.set()
        pruner.join(60)


@pytest.mark.parametrize("made_by", ["a process", "cache import", "a process, marker gone"])
def test_a_process_never_uses_an_entry_prune_is_removing(tmp_path, monkeypatch, made_by):
    """The pruner has locked the entry and is about to remove it when this process opens it for
    a warm start: that is a plain miss (trace, compile afresh), never damage."""
    from tessera.cache import archive

    root = tmp_path / "cache"
    toy = ["--backend", "eager", "--layers", "1", "--sizes", ",".join(map(str, SIZES)), "--compile-sizes", ""]
    run_toy(tmp_path / "made" if made_by == "cache import" else root, tmp_path / "a.pt", *toy)
    if made_by == "cache import":
        archive.export(tmp_path / "made", tmp_path / "cache.tar")
        assert archive.import_(root, tmp_path / "cache.tar") == 1
    (entry,) = find_entries(root)
    if made_by == "a process, marker gone":
        (entry / ".inuse").unlink()
    with paused_pruner(root, monkeypatch) as (pruner, go, removed):
        real_mark = CacheEntry._mark_in_use
        opened = []

        def mark_then_let_the_pruner_finish(self, *args, **kwargs):
            marked = real_mark(self, *args, **kwargs)
            opened.append(self.path)
            go.set()
            pruner.join(60)
            return marked

        monkeypatch.setattr(CacheEntry, "_mark_in_use", mark_then_let_the_pruner_finish)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled, _, counts = fresh_counts(backend="eager")  # outputs checked against eager
    assert not pruner.is_alive()
    assert not [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert opened[0] == entry and removed == [entry]  # it was opened warm while being removed
    assert counts["graphs_traced"] == 1 and counts["eager_compiles"] > 0  # then a plain miss
    assert compiled.cache_dir == entry and verify(root) == []  # made afresh, complete


def test_making_an_entry_prune_is_removing_waits_then_starts_afresh(tmp_path, monkeypatch, caplog):
    """A process creating the entry the pruner is removing waits for the removal to finish, then
    makes the entry again: what it writes lands in the cache, not in the pruner's trash."""
    root, factors = tmp_path / "cache", {"factor": 1}
    made = "from pathlib import Path; from tessera.cache.entry import CacheEntry; "
    made += f"CacheEntry.create(Path({str(root)!r}), 'model', {factors!r}, 'graph', [])"
    # The entry, made by a process that is gone (one of ours would keep it in use).
    subprocess.run([sys.executable, "-c", made], env=child_env(root), cwd=ROOT, check=True)
    (entry,) = find_entries(root)
    waiting = threading.Event()

    class SeenWaiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "cache prune or clear is removing it" in record.getMessage():
                waiting.set()

    caplog.set_level(logging.INFO, logger="tessera.cache.liveness")
    logging.getLogger("tessera.cache.liveness").addHandler(handler := SeenWaiting())
    try:
        with paused_pruner(root, monkeypatch) as (pruner, go, removed):
            opened: list[CacheEntry | None] = []
            creator = threading.Thread(
                target=lambda: opened.append(CacheEntry.create(root, "model", factors, "graph", []))
            )
            creator.start()
            deadline = time.monotonic() + 60
            while not waiting.is_set() and creator.is_alive():  # waiting on the pruner, or done
                assert time.monotonic() < deadline, "the creator neither waited nor finished"
                waiting.wait(0.01)
            go.set()
            pruner.join(60)
            creator.join(60)
    finally:
        logging.getLogger("tessera.cache.liveness").removeHandler(handler)
    assert removed == [entry] and not creator.is_alive()
    (store,) = opened
    assert store is not None and store.path == entry
    assert (entry / GRAPH).read_text() == "graph" and verify(root) == []
    assert tools.prune(root, 0) == []  # and it is in use by this process now


def test_prune_keeps_the_records_of_a_models_path(tmp_path):
    """A fingerprint's record that its model runs on the guarded or per-size path points to no
    entry: it is not a dangling pointer, and prune keeps it (the next process goes there at once)."""
    from tessera.cache import pointer

    root = tmp_path / "cache"
    pointer.write_path(root, "f" * 64, "guarded", "a graph break")
    pointer.write_pointer(root, "e" * 64, root / "0123456789" / "rank_0_0" / "gone")
    assert tools.prune(root, 0) == []
    assert [p.name for p in (root / "warm").glob("*.json")] == [f"{'f' * 32}.json"]
    assert pointer.read_entries(root, "f" * 64) == pointer.OtherPath("guarded", "a graph break")
    assert pointer.read_pointer(root, "f" * 64) is None


def test_verify_says_nothing_of_an_entry_removed_while_it_ran(tmp_path, monkeypatch):
    """Another process's prune removed an entry after verify listed it: no problem, no crash."""
    compiled, _, _ = fresh_counts(backend="eager")
    root, gone = compiled.cache_dir.parents[2], compiled.cache_dir.parent / "pruned-meanwhile"
    listed = tools.find_entries(root)
    monkeypatch.setattr(tools, "find_entries", lambda _: [*listed, gone])
    assert verify(root) == []


def test_a_superseded_trace_is_listed_as_the_oldest_whenever_its_save_comes(tmp_path):
    """A process adopts the newest saved trace that covers a call. A trace that a later one widened
    was saved after it when its compiles ended last, and the next process served the widened
    trace's calls from the narrow one, without the shapes learnt on the wide one."""
    from tessera.cache import pointer

    root = tmp_path / "cache"
    entry = lambda name: root / name / "rank_0_0" / "model"  # noqa: E731
    pointer.write_pointer(root, "f" * 64, entry("first"), "the first call", "a")
    pointer.write_pointer(root, "f" * 64, entry("wide"), "dim 1 changed", "b")
    pointer.write_pointer(root, "f" * 64, entry("narrow"), "the first call", "c", superseded=True)
    listed = pointer.read_entries(root, "f" * 64)
    assert not isinstance(listed, (pointer.Refused, pointer.OtherPath))
    assert [t.entry.parts[-3] for t in listed] == ["narrow", "first", "wide"]  # oldest first
