"""A fleet compiles once: Redis behind the local caches, leases, signatures, faults, ranks, images.

A real redis-server runs on a loopback port (``make test`` installs it when missing).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import tessera
from tessera.cache.archive import export, import_
from tessera.cache.blobstore import RedisStore
from tessera.cache.entry import CacheEntry
from tessera.cache.index import parse
from tessera.cache.remote import RemoteTier
from tessera.errors import CacheError, CacheWarning
from tessera.models import toy_llama
from tests.fleet import (
    ROOT,
    Stderr,
    eight_then_a_ninth,
    free_port,
    member,
    race,
    results_in,
    until,
)

pytestmark = pytest.mark.slow  # fleets of processes and a real Redis: not in make test-fast

redis = pytest.importorskip("redis", reason="the redis client is a dev dependency (make test installs it)")


# -- eight replicas, one Redis --------------------------------------------------------------------
@pytest.mark.inductor
def test_eight_replicas_compile_each_piece_once_and_a_ninth_starts_warm(tmp_path, redis_server):
    eight_then_a_ninth(tmp_path, redis_server.url)


REPLICAS = 4


def test_a_manifest_that_lacks_a_piece_still_has_it_compiled_once(tmp_path, redis_server):
    """Replicas find a manifest without one of their pieces (published before that piece was
    compiled, or by another version): one compiles it, the others wait and load it. Four replicas
    keep it quick on two cores; nothing in it depends on how many (it passes with eight)."""
    model = toy_llama.build(num_layers=2, hidden_size=64, intermediate_size=128)  # run_fleet_member's
    compiled = tessera.compile(
        model, backend="eager", cache_dir=str(tmp_path / "first"), cache_remote=redis_server.url
    )
    with torch.no_grad():
        compiled(*toy_llama.example_inputs(7))
    client = redis_server.client()
    (key,) = client.scan_iter("tessera:v1:entry:*")
    record = json.loads(client.get(key))
    body = json.loads(record["body"])
    index = parse(body["index"])
    assert len(index.entries) == 3, index.entries  # three distinct pieces: first, middle, last
    del index.entries[max(index.entries)]
    body["index"] = index.format()
    record["body"] = json.dumps(body, sort_keys=True)
    client.set(key, json.dumps(record))  # no signing key: the store is trusted as configured
    results = race(tmp_path / "fleet", redis_server.url, REPLICAS, "--backend", "eager")
    assert len(results) == REPLICAS and all(r["matched"] for r in results)
    compiles = sorted(r["counters"]["eager_compiles"] for r in results)
    assert compiles == [0] * (REPLICAS - 1) + [1], compiles  # the missing piece, once; the others loaded
    assert all(r["counters"]["cache_hits"] >= 2 for r in results), [r["counters"] for r in results]


@pytest.mark.inductor
def test_a_compiler_killed_midway_leaves_the_others_to_finish(tmp_path, redis_server):
    out = tmp_path / "out"
    out.mkdir()
    env = {"TESSERA_REMOTE_LEASE_SECONDS": "3"}
    # An empty Inductor cache: the first compiles for real, long enough to be killed midway.
    first = member(
        out,
        tmp_path / "a",
        redis_server.url,
        "--layers",
        "3",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind-a"),
        **env,
    )
    client = redis_server.client()
    deadline = time.monotonic() + 300
    while not list(client.scan_iter("tessera:v1:lease:*")):  # the first replica is compiling
        assert time.monotonic() < deadline and first.poll() is None, "no lease was ever taken"
        time.sleep(0.02)
    second = member(
        out,
        tmp_path / "b",
        redis_server.url,
        "--layers",
        "3",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "ind-b"),
        **env,
    )
    lines: list[str] = []  # the second's log, read as it comes
    reader = threading.Thread(target=lambda: lines.extend(second.stderr or ()), daemon=True)
    reader.start()
    while not any("another process is compiling" in line for line in lines):
        assert time.monotonic() < deadline and second.poll() is None, (
            "never waited:\n" + "".join(lines)[-3000:]
        )
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)  # the compiler dies holding the lease
    first.wait(timeout=30)
    started = time.monotonic()
    assert second.wait(timeout=600) == 0, "".join(lines)[-3000:]
    reader.join(timeout=30)
    (result,) = results_in(out)
    assert result["matched"] and result["counters"]["inductor_compiles"] > 0  # then took over
    assert time.monotonic() - started < 300


# -- signatures and faults (eager compiler: quick) ------------------------------------------------
def _compile_and_check(
    root: Path, remote: str, model_overrides: dict | None = None, **overrides
) -> tessera.CompiledModel:
    model = toy_llama.build(num_layers=1, **(model_overrides or {}))
    compiled = tessera.compile(model, backend="eager", cache_dir=str(root), cache_remote=remote, **overrides)
    with torch.no_grad():
        for n in (3, 8):
            ids, pos = toy_llama.example_inputs(n)
            torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    return compiled


def test_a_warm_start_from_the_remote_tier_alone(tmp_path, redis_server):
    _compile_and_check(tmp_path / "first", redis_server.url)
    tessera.counters.reset()
    warm = _compile_and_check(tmp_path / "second", redis_server.url)  # a new, empty local root
    assert warm.warm_start is True and tessera.counters.snapshot()["graphs_traced"] == 0


class HeldFetch:
    """The fleet's pointer fetch, held at a gate until the test lets it go."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tessera.cache import fleet

        self.asked, self.gate = threading.Event(), threading.Event()
        self.threads: list[str] = []
        real = fleet.fetch_pointer

        def held(*args):
            self.threads.append(threading.current_thread().name)
            self.asked.set()
            assert self.gate.wait(60), "the test never let the fetch go"
            return real(*args)

        monkeypatch.setattr(fleet, "fetch_pointer", held)


def _defaults_on(root: Path, remote: str, model, eager_first: bool = False) -> tessera.CompiledModel:
    return tessera.compile(
        model,
        backend="eager",
        cache_dir=str(root),
        cache_remote=remote,
        background_compile=True,
        eager_first=eager_first,
    )


def _check_calls(compiled, model, sizes=(3, 8, 5)) -> None:
    for n in sizes:
        ids, pos = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(ids, pos), model(ids, pos))


@pytest.mark.parametrize("published", [True, False], ids=["fleet has it", "fleet is empty"])
def test_eager_first_asks_the_store_beside_the_first_output(tmp_path, redis_server, monkeypatch, published):
    """With eager first (an option), a replica's first output waits for no request to the
    store: eager serves it while the trace thread fetches the fleet's pointer, then the fleet's
    trace serves (nothing traced) or, with none, the call is traced and compiled as on a cold start."""
    if published:
        _compile_and_check(tmp_path / "first", redis_server.url)
    tessera.counters.reset()
    fetch = HeldFetch(monkeypatch)
    model = toy_llama.build(num_layers=1)
    compiled = _defaults_on(tmp_path / "second", redis_server.url, model, eager_first=True)
    ids, pos = toy_llama.example_inputs(7)
    torch.testing.assert_close(compiled(ids, pos), model(ids, pos))  # the fetch is held meanwhile
    assert fetch.asked.wait(30) and fetch.threads == [f"tessera-trace-{compiled.name}"]
    assert tessera.counters.snapshot()["served_eagerly"] == 1
    _check_calls(compiled, model)  # served eagerly while the fetch is held
    fetch.gate.set()
    assert compiled.wait_ready(120)
    _check_calls(compiled, model)
    seen = tessera.counters.snapshot()
    assert compiled.warm_start is published
    assert seen["graphs_traced"] == (0 if published else 1)
    assert (seen["eager_compiles"] == 0) is published


def test_a_first_call_the_fleets_traces_do_not_cover_is_traced_with_what_it_changed(tmp_path, redis_server):
    """Fetched beside eager, the fleet's traces are those of a warm start: a first call none
    covers is traced for what it changed (named in its reason), and they serve the calls they do."""
    _compile_and_check(tmp_path / "first", redis_server.url)
    tessera.counters.reset()
    model = toy_llama.build(num_layers=1)
    compiled = _defaults_on(tmp_path / "second", redis_server.url, model)
    ids, pos = toy_llama.example_inputs(7)
    torch.testing.assert_close(compiled(ids.int(), pos), model(ids.int(), pos))
    assert compiled.wait_ready(120)
    (trace,) = compiled.report.traces
    assert trace.source == "traced" and "dtype" in trace.reason, trace.reason
    assert tessera.counters.snapshot()["warm_start_fallbacks"] == 1
    _check_calls(compiled, model)  # int64 ids: the fleet's trace, taken as a call needs it
    assert tessera.counters.snapshot()["graphs_traced"] == 1
    assert sorted(t.source for t in compiled.report.traces) == ["loaded", "traced"]


@pytest.mark.parametrize("eager_first", [False, True], ids=["traced first", "eager first"])
def test_a_fleet_fetch_that_fails_leaves_the_model_traced_as_on_a_cold_start(
    tmp_path, redis_server, monkeypatch, caplog, eager_first
):
    from tessera.cache import fleet

    def broken(*args):
        raise RuntimeError("a pointer nobody could read")

    monkeypatch.setattr(fleet, "fetch_pointer", broken)
    model = toy_llama.build(num_layers=1)
    compiled = _defaults_on(tmp_path / "root", redis_server.url, model, eager_first)
    with caplog.at_level("WARNING", logger="tessera"):
        _check_calls(compiled, model)
        assert compiled.wait_ready(120)
    _check_calls(compiled, model)
    said = [r.getMessage() for r in caplog.records if "fleet's traces were not fetched" in r.getMessage()]
    assert len(said) == 1 and "a pointer nobody could read" in said[0]
    assert tessera.counters.snapshot()["graphs_traced"] == 1 and compiled.report.traces[0].source == "traced"


def test_a_call_traced_on_its_own_thread_fetches_the_fleet_first(tmp_path, redis_server, monkeypatch):
    """A first call that cannot be traced in another thread (under a torch-function mode) is
    traced where it is made, after the fleet's pointer: the fleet's trace serves it."""
    with torch.device("cpu"):  # the mode is part of what a trace assumed of its calls
        _compile_and_check(tmp_path / "first", redis_server.url)
    tessera.counters.reset()
    fetch = HeldFetch(monkeypatch)
    fetch.gate.set()
    model = toy_llama.build(num_layers=1)
    compiled = _defaults_on(tmp_path / "second", redis_server.url, model)
    ids, pos = toy_llama.example_inputs(7)
    with torch.device("cpu"):
        torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    assert fetch.threads == [threading.current_thread().name]
    assert compiled.warm_start is True and tessera.counters.snapshot()["graphs_traced"] == 0


@pytest.mark.parametrize("tamper", ["unsigned", "wrong key", "edited manifest"])
def test_with_a_signing_key_nothing_unsigned_or_tampered_is_used(tmp_path, redis_server, monkeypatch, tamper):
    if tamper == "unsigned":
        _compile_and_check(tmp_path / "publisher", redis_server.url)  # published without a key
    else:
        key = "another key" if tamper == "wrong key" else "the fleet's real key"
        monkeypatch.setenv("TESSERA_CACHE_SIGNING_KEY", key)
        _compile_and_check(tmp_path / "publisher", redis_server.url)
    client = redis_server.client()
    if tamper == "edited manifest":
        for key in client.scan_iter("tessera:v1:entry:*"):
            record = json.loads(client.get(key))
            record["body"] = record["body"].replace('"format": 1', '"format": 1 ')
            client.set(key, json.dumps(record))
    monkeypatch.setenv("TESSERA_CACHE_SIGNING_KEY", "the fleet's real key")
    tessera.counters.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        consumer = _compile_and_check(tmp_path / "consumer", redis_server.url)
    messages = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert consumer.warm_start is False and tessera.counters.snapshot()["graphs_traced"] == 1
    assert messages and all("signed with another key" in m or "unsigned" in m for m in messages), messages


def test_a_signed_pointer_replayed_under_another_model_is_refused(tmp_path, redis_server, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_SIGNING_KEY", "the fleet's real key")
    client = redis_server.client()
    _compile_and_check(tmp_path / "a", redis_server.url)
    (pointer_a,) = client.scan_iter("tessera:v1:warm:*")
    other = {"eps": 0.5}  # another model: another fingerprint, other numbers
    _compile_and_check(tmp_path / "b", redis_server.url, model_overrides=other)
    (pointer_b,) = set(client.scan_iter("tessera:v1:warm:*")) - {pointer_a}
    client.set(pointer_b, client.get(pointer_a))  # someone without the key copies A's pointer
    tessera.counters.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        consumer = _compile_and_check(tmp_path / "c", redis_server.url, model_overrides=other)
    assert consumer.warm_start is False and tessera.counters.snapshot()["graphs_traced"] == 1
    assert any("names another model" in str(w.message) for w in caught)


def test_a_manifest_naming_a_file_outside_the_entry_writes_nothing_there(tmp_path, redis_server):
    _compile_and_check(tmp_path / "publisher", redis_server.url)
    client = redis_server.client()
    payload = b"echo owned"
    sha = hashlib.sha256(payload).hexdigest()
    client.set(f"tessera:v1:blob:{sha}", payload)
    for key in client.scan_iter("tessera:v1:entry:*"):  # no signing key: trusted as configured
        record = json.loads(client.get(key))
        body = json.loads(record["body"])
        body["files"]["../../../escaped.sh"] = sha
        record["body"] = json.dumps(body, sort_keys=True)
        client.set(key, json.dumps(record))
    client.delete(*client.scan_iter("tessera:v1:warm:*"))  # no pointer: the entry is fetched by key
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compile_and_check(tmp_path / "consumer", redis_server.url)
    assert not list(tmp_path.rglob("escaped.sh"))
    assert any("malformed" in str(w.message) for w in caught)


@pytest.mark.parametrize("fault", ["stopped", "paused", "flushed", "unreachable"])
def test_redis_faults_cost_one_warning_and_never_a_wrong_result(tmp_path, redis_server, monkeypatch, fault):
    """Refused, hanging (paused), emptied or never there: one warning, right results, and each
    first output late by at most TESSERA_REMOTE_TIMEOUT_SECONDS, however many calls fail."""
    timeout = 0.5
    monkeypatch.setenv("TESSERA_REMOTE_TIMEOUT_SECONDS", str(timeout))
    started = time.monotonic()
    _compile_and_check(tmp_path / "alone", None)  # the same work without a store, for the bound
    alone = time.monotonic() - started
    url = redis_server.url if fault != "unreachable" else f"redis://127.0.0.1:{free_port()}/0"
    if fault != "unreachable":
        _compile_and_check(tmp_path / "one", url)
    if fault == "stopped":
        redis_server.stop()
    elif fault == "paused":
        redis_server.pause()
    elif fault == "flushed":
        redis_server.client().flushall()
    tessera.counters.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for root in ("two", "three"):
            started = time.monotonic()
            _compile_and_check(tmp_path / root, url)
            assert time.monotonic() - started <= timeout + 2 * alone + 1, (root, time.monotonic() - started)
    messages = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert len(messages) == (0 if fault == "flushed" else 1), messages
    assert tessera.counters.snapshot()["graphs_traced"] >= 1


def test_a_piece_that_could_not_be_written_locally_is_never_published(tmp_path, redis_server, monkeypatch):
    """A full disk while recording a piece: the manifest would lack it, and send the fleet to
    compile it while believing the entry complete. Nothing is published; the next replica compiles."""

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    record_artifact = CacheEntry.record_artifact
    monkeypatch.setattr(CacheEntry, "record_artifact", disk_full)
    with pytest.warns(CacheWarning, match="No space left on device"):
        _compile_and_check(tmp_path / "full", redis_server.url)
    client = redis_server.client()
    assert not list(client.scan_iter("tessera:v1:entry:*")), "a manifest of pieces never written"
    # The disk has room again (only this patch undone: the suite's settings stay as they are).
    monkeypatch.setattr(CacheEntry, "record_artifact", record_artifact)
    tessera.counters.reset()
    _compile_and_check(tmp_path / "next", redis_server.url)
    assert tessera.counters.snapshot()["eager_compiles"] > 0 and list(client.scan_iter("tessera:v1:entry:*"))


def test_the_lease_holder_publishes_its_entry_once(tmp_path, redis_server, monkeypatch):
    """The entry's manifest is published once, by the lease holder, before it lets the lease go;
    the whole-model artifact travels with its pointer, and a new process still starts warm."""
    published: list[str] = []
    put = RedisStore.put

    def counted(self: RedisStore, key: str, value: bytes) -> None:
        published.append(key)
        put(self, key, value)

    monkeypatch.setattr(RedisStore, "put", counted)
    _compile_and_check(tmp_path / "holder", redis_server.url)
    manifests = [k for k in published if k.startswith("tessera:v1:entry:")]
    assert len(manifests) == 1, published
    assert len([k for k in published if k.startswith("tessera:v1:warm:")]) == 1, published
    tessera.counters.reset()
    warm = _compile_and_check(tmp_path / "empty disk", redis_server.url)
    assert warm.warm_start is True and tessera.counters.snapshot()["graphs_traced"] == 0


def test_redis_restarted_during_a_call_is_retried_within_the_timeout(tmp_path, redis_server, monkeypatch):
    """Redis restarts just as the lease is taken: the call is tried again after a pause (one
    warning), finds it back, and the process compiles, publishes and shares as usual."""
    monkeypatch.setenv("TESSERA_REMOTE_TIMEOUT_SECONDS", "30")  # far longer than a restart
    attempts: list[float] = []
    take = RedisStore.put_if_absent

    def restarting(self: RedisStore, *args):
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            redis_server.stop()  # the first attempt finds Redis gone
        elif len(attempts) == 2:
            redis_server.start()  # the attempt after the pause finds it back (empty)
        return take(self, *args)

    monkeypatch.setattr(RedisStore, "put_if_absent", restarting)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compile_and_check(tmp_path / "one", redis_server.url)
    messages = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert len(messages) == 1 and "retrying" in messages[0], messages
    assert len(attempts) >= 2, "the failed call was never tried again"
    client = redis_server.client()
    assert list(client.scan_iter("tessera:v1:entry:*")) and list(client.scan_iter("tessera:v1:warm:*"))
    tessera.counters.reset()
    warm = _compile_and_check(tmp_path / "two", redis_server.url)
    assert warm.warm_start is True and tessera.counters.snapshot()["graphs_traced"] == 0


def test_redis_stopped_then_restarted_mid_fleet(tmp_path, redis_server):
    """Four replicas: one holds the lease, compiling; three wait. Redis stops, each waiter sees it
    fail (one warning each), and Redis comes back, empty, within the timeout. The waiters go on
    without the holder: one takes the new lease and compiles, two load its pieces, each first
    output within the timeout of the fault. Then the holder finishes: it lost its lease to the
    restart, says so once, and its results are right too."""
    timeout = 10.0
    env = {"TESSERA_REMOTE_TIMEOUT_SECONDS": str(timeout)}
    out, gate = tmp_path / "out", tmp_path / "gate"
    out.mkdir()
    gate.mkdir()
    procs = [
        member(
            out, tmp_path / f"local{i}", redis_server.url, "--backend", "eager", "--hold", str(gate), **env
        )
        for i in range(4)
    ]
    logs = [Stderr(p) for p in procs]
    until(
        lambda: (
            (gate / "holder").exists()
            and sum(log.count("another process is compiling") > 0 for log in logs) == 3
        ),
        procs,
        "one replica holds the lease and three wait for it",
    )
    redis_server.stop()
    stopped = time.time()
    until(lambda: sum(log.count("CacheWarning") for log in logs) == 3, procs, "each waiter saw Redis fail")
    redis_server.start()
    until(lambda: len(list(out.glob("*.json"))) == 3, procs, "the waiters finished without the holder")
    released = time.time()
    (gate / "release").touch()
    texts = [log.finish() for log in logs]
    results = results_in(out)
    assert len(results) == 4 and all(r["matched"] for r in results)
    warned = [text.count("CacheWarning:") for text in texts]
    assert warned == [1, 1, 1, 1], "\n----\n".join(t[-2000:] for t in texts)
    holder = max(results, key=lambda r: r["first_output_at"])
    waiters = [r for r in results if r is not holder]
    assert all(r["first_output_at"] - stopped <= timeout + 5 for r in waiters), [
        r["first_output_at"] - stopped for r in waiters
    ]
    assert holder["first_output_at"] - released <= timeout + 5
    # The holder, and one waiter after the restart: not every replica on its own.
    assert sorted(r["counters"]["eager_compiles"] > 0 for r in results) == [False, False, True, True], [
        r["counters"] for r in results
    ]


@pytest.mark.parametrize("value", ["soon", "0", "-5"])
def test_a_bad_remote_timing_variable_is_a_config_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("TESSERA_REMOTE_LEASE_SECONDS", value)
    with pytest.raises(tessera.ConfigError, match="TESSERA_REMOTE_LEASE_SECONDS"):
        RemoteTier("redis://127.0.0.1:1/0")


def test_an_evicted_blob_is_a_miss_not_a_failure(tmp_path, redis_server):
    _compile_and_check(tmp_path / "one", redis_server.url)
    client = redis_server.client()
    for key in list(client.scan_iter("tessera:v1:blob:*"))[:1]:  # maxmemory evicted one file
        client.delete(key)
    tessera.counters.reset()
    again = _compile_and_check(tmp_path / "two", redis_server.url)
    assert again.warm_start is False and tessera.counters.snapshot()["graphs_traced"] == 1


def test_blobs_stream_from_redis_in_ranges_and_land_whole(tmp_path, redis_server, monkeypatch):
    """A blob is read in ranges (never a whole file of GBs in memory), several blobs at once; the
    entry it makes starts the next process warm with eager's numbers."""
    _compile_and_check(tmp_path / "one", redis_server.url)
    client = redis_server.client()
    sizes = [client.strlen(key) for key in client.scan_iter("tessera:v1:blob:*")]
    chunk = 1024
    assert max(sizes) > 2 * chunk, sizes  # some blob takes several ranges
    monkeypatch.setattr("tessera.cache.blobstore.CHUNK_BYTES", chunk)
    ranges: list[tuple[int, int]] = []
    getrange = redis.Redis.getrange

    def counted(self, key, start, end):
        ranges.append((start, end))
        return getrange(self, key, start, end)

    monkeypatch.setattr(redis.Redis, "getrange", counted)
    tessera.counters.reset()
    again = _compile_and_check(tmp_path / "two", redis_server.url)
    counted_now = tessera.counters.snapshot()
    assert again.warm_start is True and counted_now["graphs_traced"] == 0
    assert max(end - start + 1 for start, end in ranges) <= chunk
    # Every byte of every blob came in a range.
    assert counted_now["remote_bytes_read"] == sum(end - start + 1 for start, end in ranges) > 2 * chunk


# -- ranks ----------------------------------------------------------------------------------------
def _torchrun(tmp_path: Path, out: Path, *args: str) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    env = dict(os.environ, TESSERA_CACHE_DIR=str(tmp_path / "shared-root"), PYTHONPATH=str(ROOT))
    env.pop("TESSERA_CACHE_REMOTE", None)
    cmd = [str(torchrun), "--nproc-per-node", "4", "--master-port", str(free_port())]
    cmd += ["-m", "tests.run_fleet_member", str(out), "--distributed", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


@pytest.mark.inductor
def test_four_ranks_with_identical_graphs_compile_once(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _torchrun(tmp_path, out)
    results = results_in(out)
    assert len(results) == 4 and all(r["matched"] for r in results)
    assert sum(r["counters"]["inductor_compiles"] for r in results) == 3  # one rank's compiles


def test_four_ranks_with_different_graphs_still_work(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    _torchrun(tmp_path, out, "--backend", "eager", "--rank-width")
    results = results_in(out)
    assert len(results) == 4 and all(r["matched"] for r in results)
    assert all(r["counters"]["graphs_traced"] == 1 for r in results)


# -- baking a cache into an image -----------------------------------------------------------------
def test_export_then_import_into_another_root_starts_warm(tmp_path):
    source = tmp_path / "source"
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager", cache_dir=str(source), prefix="backbone")
    with torch.no_grad():
        compiled(*toy_llama.example_inputs(5))
    archive = tmp_path / "image.tar"
    assert export(source, archive, prefixes=["backbone"]) == 1
    full_key = compiled._split_model.entry.key
    assert len(full_key) > 10 and export(source, tmp_path / "by-key.tar", keys=[full_key]) == 1
    assert export(source, tmp_path / "none.tar", keys=["f" * 64 if full_key[0] != "f" else "0" * 64]) == 0
    target = tmp_path / "elsewhere" / "root"
    assert import_(target, archive) == 1
    tessera.counters.reset()
    warm = tessera.compile(model, backend="eager", cache_dir=str(target), prefix="backbone")
    with torch.no_grad():
        torch.testing.assert_close(warm(*toy_llama.example_inputs(9)), model(*toy_llama.example_inputs(9)))
    assert warm.warm_start is True and tessera.counters.snapshot()["graphs_traced"] == 0


def test_import_refuses_paths_outside_the_root_and_damaged_entries(tmp_path):
    evil = tmp_path / "evil.tar"
    payload = tmp_path / "payload"
    payload.write_text("x")
    with tarfile.open(evil, "w") as tar:
        tar.add(payload, arcname="../../escaped")
    with pytest.raises(CacheError, match="outside the cache root"):
        import_(tmp_path / "root", evil)
    assert not (tmp_path / "escaped").exists()
    source = tmp_path / "source"
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager", cache_dir=str(source))
    with torch.no_grad():
        compiled(*toy_llama.example_inputs(5))
    (compiled.cache_dir / "computation_graph.py").write_text("tampered")
    archive = tmp_path / "damaged.tar"
    export(source, archive)
    with pytest.raises(CacheError, match="nothing imported"):
        import_(tmp_path / "root2", archive)
    assert not list((tmp_path / "root2").glob("*/rank_*"))


def test_taking_from_a_sibling_rank_skips_files_that_are_gone(tmp_path):
    """A sibling entry pruned midway: what is still there is taken, the rest left to compile."""
    from tessera.cache.entry import FACTORS, INDEX
    from tessera.cache.index import ArtifactRecord, Index
    from tessera.cache.sharing import _take_from_siblings

    ours, sibling = tmp_path / "key" / "rank_0_0" / "p", tmp_path / "key" / "rank_1_0" / "p"
    for entry in (ours, sibling):
        (entry / "artifacts").mkdir(parents=True)
        (entry / FACTORS).write_text('{"same": "key"}')
    data = b"compiled piece"
    sha = hashlib.sha256(data).hexdigest()
    (sibling / "artifacts" / "a.bin").write_bytes(data)
    present = ArtifactRecord("artifacts/a.bin", sha, len(data), "c1")
    gone = ArtifactRecord("artifacts/b.bin", sha, len(data), "c2")
    index = Index(created=time.time())
    index.entries.update({("general", 0, "inductor"): present, ("general", 1, "inductor"): gone})
    (sibling / INDEX).write_text(index.format())
    store = CacheEntry(ours, {}, "key")
    _take_from_siblings(store)
    assert list(store.index.entries.values()) == [present]
    assert (ours / "artifacts" / "a.bin").read_bytes() == data and not (ours / "artifacts" / "b.bin").exists()


def test_sizes_one_replica_learnt_are_served_by_a_replica_with_an_empty_local_cache(tmp_path, redis_server):
    from tessera.serving import learn

    first = _compile_and_check(tmp_path / "first", redis_server.url, compile_sizes="auto")
    ids, pos = toy_llama.example_inputs(3)
    for _ in range(2 * learn.EVERY):
        first(ids, pos)
    assert first.wait_ready(60) and first.report.learnt_sizes == (3,)
    torch._dynamo.reset()
    tessera.counters.reset()
    second = _compile_and_check(tmp_path / "second", redis_server.url, compile_sizes="auto")
    assert second.warm_start is True and second.report.learnt_sizes == (3,)
    assert tessera.counters.snapshot()["eager_compiles"] == 0
    runner = next(r for r in second.runners.values() if r.source is not None)
    assert runner.artifact_for(3) == "size 3"


def test_the_trace_plan_travels_with_the_pointer(tmp_path, redis_server):
    """What one replica's traces found changing reaches a replica with an empty local cache, so
    that its next new kind of call is traced as wide as the first replica's would be."""
    import json

    first = _compile_and_check(tmp_path / "first", redis_server.url)
    assert first.wait_ready(60)
    (pointer,) = (tmp_path / "first").rglob("warm/*.json")
    plan = json.loads(pointer.read_text()).get("plan")
    assert plan and any(plan.values()), plan
    torch._dynamo.reset()
    second = _compile_and_check(tmp_path / "second", redis_server.url)
    assert second.warm_start is True
    (fetched,) = (tmp_path / "second").rglob("warm/*.json")
    assert json.loads(fetched.read_text()).get("plan") == plan
