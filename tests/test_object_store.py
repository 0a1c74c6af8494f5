"""The remote tier in an object store: a real S3 server (moto's) on a loopback port, and a shared
directory (file://). Leases by conditional writes, a fleet that compiles each piece once with no
Redis, faults, altered blobs.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import tessera
from tessera.cache.entry import INDEX
from tessera.cache.index import parse
from tessera.cache.objectstore import RELEASED, ObjectStore
from tessera.cache.remote import NAMESPACE, RemoteTier
from tessera.errors import CacheWarning
from tessera.models import toy_llama
from tests.fleet import Stderr, eight_then_a_ninth, member, race, results_in, until, wait_all

pytestmark = pytest.mark.slow  # a real S3 server and fleets of processes: not in make test-fast
pytest.importorskip("obstore", reason="obstore is a dev dependency (make test installs it)")


@pytest.fixture(params=["s3", "file"])
def store_url(request, tmp_path) -> str:
    """The tier's URL on each kind of object store the tests can run."""
    if request.param == "s3":
        return str(request.getfixturevalue("s3_server").url)
    return f"file://{tmp_path / 'shared'}"


def _compile_and_check(root: Path, remote: str, backend: str = "eager", **overrides) -> tessera.CompiledModel:
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend=backend, cache_dir=str(root), cache_remote=remote, **overrides)
    for n in (3, 8, 13):  # grad enabled, as a server that forgot no_grad runs it
        ids, pos = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    return compiled


# -- leases by conditional writes -----------------------------------------------------------------
def test_a_lease_is_held_by_one_and_given_back_to_the_next(store_url):
    one, two = ObjectStore(store_url, 5.0), ObjectStore(store_url, 5.0)
    key = f"{NAMESPACE}lease:k:p"
    assert one.put_if_absent(key, b"one", 30) and not two.put_if_absent(key, b"two", 30)
    assert one.renew(key, b"one", 30) and not two.renew(key, b"two", 30)
    assert not two.delete_if(key, b"two")  # only its holder gives it back
    assert not two.put_if_absent(key, b"two", 30)  # renewed: still held
    assert one.delete_if(key, b"one")
    assert one.get(key) == RELEASED
    assert two.put_if_absent(key, b"two", 30) and not one.put_if_absent(key, b"one", 30)


@pytest.mark.parametrize("state", ["absent", "given back"])
def test_eight_threads_racing_for_a_lease_one_wins(store_url, state):
    key = f"{NAMESPACE}lease:race:{state}"
    if state == "given back":
        first = ObjectStore(store_url, 5.0)
        assert first.put_if_absent(key, b"first", 30) and first.delete_if(key, b"first")
    stores = [ObjectStore(store_url, 5.0) for _ in range(8)]
    won: list[int] = []
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        if stores[i].put_if_absent(key, f"r{i}".encode(), 30):
            won.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1, won
    assert stores[0].get(key).split(b" ")[0] == f"r{won[0]}".encode()


def test_a_conditional_write_refused_on_its_own_retry_still_holds(store_url, monkeypatch):
    """obstore retries a dropped connection: a create or renewal that landed the first time is
    refused the second. The lease is still this replica's, and it says so."""
    store = ObjectStore(store_url, 5.0)
    key = f"{NAMESPACE}lease:retried:p"
    write = ObjectStore._write

    def landed_then_refused(self, path, body, mode=None):
        write(self, path, body, mode)
        if path.startswith("tessera/v1/lease/") and mode is not None:  # a conditional write
            raise (self._stale_error if isinstance(mode, dict) else self._exists_error)("refused on retry")

    monkeypatch.setattr(ObjectStore, "_write", landed_then_refused)
    assert store.put_if_absent(key, b"one", 30)
    assert store.renew(key, b"one", 30)
    assert not ObjectStore(store_url, 5.0).put_if_absent(key, b"two", 30)


def test_odd_cache_prefixes_make_distinct_valid_object_names(store_url):
    store = ObjectStore(store_url, 5.0)
    prefixes = ["a:b", "a", "..", ".", "x/y", "x:y", "with space", "%41"]
    for i, prefix in enumerate(prefixes):
        store.put(f"{NAMESPACE}entry:{'ab' * 8}:{prefix}", str(i).encode())
    for i, prefix in enumerate(prefixes):
        assert store.get(f"{NAMESPACE}entry:{'ab' * 8}:{prefix}") == str(i).encode()


def test_an_abandoned_lease_expires_by_the_stores_clock(store_url):
    holder, waiter = ObjectStore(store_url, 5.0), ObjectStore(store_url, 5.0)
    key = f"{NAMESPACE}lease:abandoned:p"
    ttl = 1.0
    assert holder.put_if_absent(key, b"holder", ttl)
    taken_at = time.monotonic()
    assert not waiter.put_if_absent(key, b"waiter", ttl)  # fresh: held
    # The holder never renews: the lease is taken once it is older than its time (within the
    # store clock's one-second resolution), and not before.
    deadline = taken_at + 30
    while not waiter.put_if_absent(key, b"waiter", ttl):
        assert time.monotonic() < deadline, "an abandoned lease never expired"
        time.sleep(0.1)
    assert time.monotonic() - taken_at >= ttl
    assert not holder.renew(key, b"holder", ttl)  # it is the waiter's now


def test_a_renewed_lease_does_not_expire(store_url):
    holder, waiter = ObjectStore(store_url, 5.0), ObjectStore(store_url, 5.0)
    key = f"{NAMESPACE}lease:renewed:p"
    ttl = 1.5
    assert holder.put_if_absent(key, b"holder", ttl)
    end = time.monotonic() + 3 * ttl
    while time.monotonic() < end:  # renewed every ttl/3, as the tier's renewer does
        assert holder.renew(key, b"holder", ttl)
        assert not waiter.put_if_absent(key, b"waiter", ttl)
        time.sleep(ttl / 3)


# -- the tier ---------------------------------------------------------------------------------------
def test_a_warm_start_from_the_object_store_alone(tmp_path, store_url):
    _compile_and_check(tmp_path / "first", store_url)
    tessera.counters.reset()
    warm = _compile_and_check(tmp_path / "second", store_url)  # a new, empty local root
    seen = tessera.counters.snapshot()
    assert warm.warm_start is True and seen["graphs_traced"] == 0 and seen["eager_compiles"] == 0
    assert seen["remote_bytes_read"] > 0 and seen["remote_requests"] > 0


def test_blobs_are_named_by_their_content_and_never_rewritten(tmp_path, s3_server):
    _compile_and_check(tmp_path / "first", s3_server.url)
    blobs = s3_server.keys("tessera/v1/blob/")
    assert blobs
    for name in blobs:
        assert hashlib.sha256(s3_server.read(name)).hexdigest() == name.rsplit("/", 1)[1]
    # A second writer of a blob (a replica that compiled the same piece) leaves the first's.
    name = blobs[0]
    before = s3_server.read(name)
    ObjectStore(s3_server.url, 5.0).add(name.replace("/", ":"), b"other bytes")
    assert s3_server.read(name) == before
    # And a replica publishing an entry the store has moves no blob bytes.
    (manifest,) = s3_server.keys("tessera/v1/entry/")
    *_, key, prefix = manifest.split("/")
    (entry,) = [p.parent for p in (tmp_path / "first").rglob(INDEX) if p.parent.name == prefix]
    tessera.counters.reset()
    tier = RemoteTier(s3_server.url, ObjectStore(s3_server.url, 5.0))
    assert tier.publish(entry, key, prefix)
    assert tessera.counters.snapshot()["remote_bytes_written"] == 0


def test_a_superseded_traces_entry_is_published_but_not_its_pointer(tmp_path, s3_server):
    """The store's pointer names one entry, the last published: a trace that a later one widened
    publishes its entry (replicas may wait on its compile) and leaves the pointer to the trace
    that serves, whichever finishes its compiles last."""
    from types import SimpleNamespace

    from tessera.cache import fleet

    first = _compile_and_check(tmp_path / "first", s3_server.url)
    assert first.wait_ready(60)
    (pointer_name,) = s3_server.keys("tessera/v1/warm/")
    (manifest,) = s3_server.keys("tessera/v1/entry/")
    *_, key, prefix = manifest.split("/")
    (path,) = [p.parent for p in (tmp_path / "first").rglob(INDEX) if p.parent.name == prefix]
    entry = SimpleNamespace(key=key, path=path)
    fingerprint = pointer_name.rsplit("/", 1)[1]
    for name in (pointer_name, manifest):
        s3_server.delete(name)
    tier = RemoteTier(s3_server.url, ObjectStore(s3_server.url, 5.0))
    fleet.publish(tier, tmp_path / "first", fingerprint, entry, superseded=True)
    assert s3_server.keys("tessera/v1/entry/") == [manifest]
    assert s3_server.keys("tessera/v1/warm/") == []
    fleet.publish(tier, tmp_path / "first", fingerprint, entry)
    assert s3_server.keys("tessera/v1/warm/") == [pointer_name]


def _blob_of(s3_server, which: str) -> str:
    """The store's name of a blob the first replica published: a piece's, or the whole model's."""
    (pointer,) = s3_server.keys("tessera/v1/warm/")
    sha = json.loads(json.loads(s3_server.read(pointer))["body"])["model"]["sha256"]
    if which == "piece":
        (manifest,) = s3_server.keys("tessera/v1/entry/")
        index = parse(json.loads(json.loads(s3_server.read(manifest))["body"])["index"])
        sha = next(record.sha256 for record in index.entries.values() if record.file)
    return f"tessera/v1/blob/{sha}"


@pytest.mark.parametrize("which", [pytest.param("piece", marks=pytest.mark.inductor), "whole model"])
def test_an_altered_blob_is_refused_by_its_digest_and_repaired(tmp_path, s3_server, which):
    """A piece's artifact altered (Inductor's: the eager compiler writes none) is compiled again;
    the whole-model artifact altered, the pieces load. Either way the next replica starts warm."""
    backend = "inductor" if which == "piece" else "eager"
    _compile_and_check(tmp_path / "first", s3_server.url, backend)
    name = _blob_of(s3_server, which)
    good = s3_server.read(name)
    s3_server.write(name, good[:-1] + bytes([good[-1] ^ 1]))  # one bit flipped in the store
    tessera.counters.reset()
    with pytest.warns(CacheWarning, match="do\\(es\\) not match the sha256") as caught:
        again = _compile_and_check(tmp_path / "second", s3_server.url, backend)
    assert sum(issubclass(w.category, CacheWarning) for w in caught) == 1
    compiled = tessera.counters.snapshot()[f"{backend}_compiles"]
    assert again.warm_start is False
    # A piece is compiled again; with only the whole-model artifact altered, the pieces load.
    assert compiled > 0 if which == "piece" else compiled == 0
    tessera.counters.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # repaired: nothing altered is met again
        third = _compile_and_check(tmp_path / "third", s3_server.url, backend)
    assert third.warm_start is True and tessera.counters.snapshot()[f"{backend}_compiles"] == 0
    if which == "piece":  # the fleet is healed: the blob put right, or the manifest names another
        named = s3_server.read(s3_server.keys("tessera/v1/entry/")[0])
        assert s3_server.read(name) == good or name.rsplit("/", 1)[1].encode() not in named


def test_a_manifest_whose_blob_never_arrived_is_a_miss(tmp_path, s3_server):
    """A partial upload is never read: a manifest naming a blob the store lacks is not used."""
    _compile_and_check(tmp_path / "first", s3_server.url)
    s3_server.delete(s3_server.keys("tessera/v1/blob/")[0])
    tessera.counters.reset()
    again = _compile_and_check(tmp_path / "second", s3_server.url)
    assert again.warm_start is False and tessera.counters.snapshot()["graphs_traced"] == 1


def test_the_store_down_from_the_start_costs_one_warning_and_the_timeout(tmp_path, s3_server, monkeypatch):
    monkeypatch.setenv("TESSERA_REMOTE_TIMEOUT_SECONDS", "2")
    s3_server.stop()
    start = time.monotonic()
    with pytest.warns(CacheWarning, match="using the local cache only") as caught:
        compiled = _compile_and_check(tmp_path / "alone", s3_server.url)
    assert time.monotonic() - start < 2 + 15  # the budget, plus tracing and three eager calls
    assert compiled.warm_start is False
    assert sum(issubclass(w.category, CacheWarning) for w in caught) == 1


def test_a_shared_directory_that_cannot_be_made_is_one_warning_and_the_local_cache(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.warns(CacheWarning, match="opening the store failed"):
        compiled = _compile_and_check(tmp_path / "local", f"file://{blocker}/shared")
    assert compiled.warm_start is False and tessera.counters.snapshot()["eager_compiles"] > 0


def test_credentials_from_a_credentials_file(tmp_path, s3_server, monkeypatch):
    """No AWS key in the environment: boto3's chain reads the credentials file."""
    pytest.importorskip("boto3", reason="boto3 comes with moto, a dev dependency")
    from tessera.cache.objectstore import _boto3_credentials

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert _boto3_credentials() is None  # nothing anywhere: obstore's own chain
    credentials = tmp_path / "credentials"
    credentials.write_text("[default]\naws_access_key_id = from-file\naws_secret_access_key = secret\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    provider = _boto3_credentials()
    assert provider is not None and provider()["access_key_id"] == "from-file"
    _compile_and_check(tmp_path / "first", s3_server.url)
    assert s3_server.keys("tessera/v1/warm/")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"cache_remote": "s3://"}, "names no bucket"),
        ({"cache_remote": "file://relative/dir"}, "no absolute path"),
        ({"cache_remote": "ftp://host/dir"}, "must be a Redis URL"),
        ({"cache_remote": "s3://b/p", "cache_remote_leases": "s3://b/q"}, "must be a Redis URL"),
        ({"cache_remote": "redis://h:1/0", "cache_remote_leases": "redis://h:1/0"}, "object-store tier"),
    ],
)
def test_a_bad_object_store_url_is_a_config_error(fields, message):
    with pytest.raises(tessera.ConfigError, match=message):
        tessera.CompileConfig(**fields)


# -- fleets ---------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_eight_replicas_on_one_bucket_compile_each_piece_once_and_a_ninth_starts_warm(tmp_path, s3_server):
    """On the defaults (background compile): each replica traces its first call and answers as
    traced while the lease holder compiles; the fleet compiles each piece once all the same."""
    results = eight_then_a_ninth(tmp_path, s3_server.url, TESSERA_BACKGROUND_COMPILE="1")
    assert all(r["counters"].get("served_eagerly", 0) == 0 for r in results), [r["counters"] for r in results]


def test_a_shared_directory_fleet_compiles_once(tmp_path):
    results = race(tmp_path, f"file://{tmp_path / 'shared'}", 3, "--backend", "eager")
    assert len(results) == 3 and all(r["matched"] for r in results)
    assert sorted(r["counters"]["eager_compiles"] > 0 for r in results) == [False, False, True]


def test_leases_in_redis_beside_the_object_store(tmp_path, s3_server, redis_server):
    env = {"TESSERA_CACHE_REMOTE_LEASES": redis_server.url}
    results = race(tmp_path, s3_server.url, 3, "--backend", "eager", **env)
    assert len(results) == 3 and all(r["matched"] for r in results)
    assert sorted(r["counters"]["eager_compiles"] > 0 for r in results) == [False, False, True]
    assert list(redis_server.client().scan_iter("tessera:v1:lease:*")) == []  # given back
    assert not s3_server.keys("tessera/v1/lease/")  # none in the store
    assert s3_server.keys("tessera/v1/blob/") and s3_server.keys("tessera/v1/entry/")


def test_a_fleet_whose_store_is_down_from_the_start(tmp_path, s3_server):
    """Three replicas, the store stopped before they start: each serves right results, warns once
    and waits no longer than the timeout for the store."""
    timeout = 2.0
    s3_server.stop()
    out = tmp_path / "out"
    out.mkdir()
    env = {"TESSERA_REMOTE_TIMEOUT_SECONDS": str(timeout)}
    procs = [
        member(out, tmp_path / f"local{i}", s3_server.url, "--backend", "eager", **env) for i in range(3)
    ]
    logs = [Stderr(p) for p in procs]
    texts = [log.finish() for log in logs]
    results = results_in(out)
    assert len(results) == 3 and all(r["matched"] for r in results)
    assert [text.count("CacheWarning:") for text in texts] == [1, 1, 1], texts[0][-2000:]
    # The store's budget, spent once however many requests failed: counted (the time lost to the
    # store), since the first call's wall time is mostly a trace and compiles, which a busy machine
    # stretches (12 s once in CI, for 2 s of budget). The wall bound is a guard against a hang.
    lost = [r["counters"].get("remote_fault_ms", 0) for r in results]
    assert all(0 < ms <= timeout * 1000 + 500 for ms in lost), lost
    assert all(r["call_seconds"] <= timeout + 60 for r in results), [r["call_seconds"] for r in results]
    assert all(r["counters"]["eager_compiles"] > 0 for r in results)


def test_the_store_stopped_then_restarted_mid_compile(tmp_path, s3_server):
    """Three replicas: one holds the lease, compiling; two wait. The store stops and comes back
    empty (its bucket made again, as an operator restoring it would). Every replica serves right
    results: none hangs past the timeout of the fault, none reads a partial entry."""
    timeout = 4.0
    env = {"TESSERA_REMOTE_TIMEOUT_SECONDS": str(timeout)}
    out, gate = tmp_path / "out", tmp_path / "gate"
    out.mkdir()
    gate.mkdir()
    procs = [
        member(out, tmp_path / f"local{i}", s3_server.url, "--backend", "eager", "--hold", str(gate), **env)
        for i in range(3)
    ]
    logs = [Stderr(p) for p in procs]
    until(
        lambda: (
            (gate / "holder").exists()
            and sum(log.count("another process is compiling") > 0 for log in logs) == 2
        ),
        procs,
        "one replica holds the lease and two wait for it",
    )
    s3_server.stop()
    stopped = time.time()
    until(lambda: len(list(out.glob("*.json"))) == 2, procs, "the waiters finished without the holder")
    s3_server.start()
    released = time.time()
    (gate / "release").touch()
    texts = [log.finish() for log in logs]
    results = results_in(out)
    assert len(results) == 3 and all(r["matched"] for r in results), texts
    assert all(text.count("CacheWarning:") <= 1 for text in texts), "\n----\n".join(t[-2000:] for t in texts)
    holder = max(results, key=lambda r: r["first_output_at"])
    waiters = [r for r in results if r is not holder]
    assert all(r["first_output_at"] - stopped <= timeout + 10 for r in waiters), [
        r["first_output_at"] - stopped for r in waiters
    ]
    assert holder["first_output_at"] - released <= timeout + 10
    # After the restart the holder published into the empty store: a fourth replica starts warm.
    fourth = tmp_path / "fourth"
    fourth.mkdir()
    wait_all([member(fourth, tmp_path / "local4", s3_server.url, "--backend", "eager")])
    (result,) = results_in(fourth)
    assert result["matched"] and result["warm_start"] is True and result["counters"]["eager_compiles"] == 0


def test_a_lease_holder_killed_midway_leaves_the_lease_to_expire(tmp_path, s3_server):
    """The holder dies (SIGKILL) holding the lease, before it publishes anything: a waiter takes
    the lease once it has gone unrenewed for its time, compiles, and serves right results."""
    lease = 2.0
    env = {"TESSERA_REMOTE_LEASE_SECONDS": str(lease)}
    out, gate = tmp_path / "out", tmp_path / "gate"
    out.mkdir()
    gate.mkdir()
    holder = member(out, tmp_path / "a", s3_server.url, "--backend", "eager", "--hold", str(gate), **env)
    until((gate / "holder").exists, [holder], "the first replica holds the lease")
    waiter = member(out, tmp_path / "b", s3_server.url, "--backend", "eager", **env)
    log = Stderr(waiter)
    until(lambda: log.count("another process is compiling") > 0, [waiter], "the second waits")
    holder.kill()
    holder.wait(timeout=30)
    killed = time.time()
    log.finish()
    (result,) = results_in(out)
    assert result["matched"] and result["counters"]["eager_compiles"] > 0  # it took over
    # Taken within the lease's time and a few polls, not after TESSERA_REMOTE_WAIT_SECONDS.
    assert result["first_output_at"] - killed < lease + 10


@pytest.mark.inductor
def test_a_replica_serves_as_traced_while_the_lease_holder_compiles(tmp_path, s3_server):
    """A fleet serves while it compiles: the second replica answers (eagerly, then its pieces as
    traced) while the first holds the lease in its compile, compiles nothing itself, and loads
    what the holder publishes once it lets go."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    out.mkdir()
    gate.mkdir()
    # And eager first, and a compile worker for the general artifacts: the defaults.
    defaults = {"TESSERA_BACKGROUND_COMPILE": "1", "TESSERA_COMPILE_WORKERS": ""}
    holder = member(out, tmp_path / "a", s3_server.url, "--hold", str(gate), **defaults)
    until((gate / "holder").exists, [holder], "the first replica holds the lease in its compile")
    second = member(out, tmp_path / "b", s3_server.url, **defaults)
    log = Stderr(second)
    early = out / "early" / f"replica-{second.pid}.json"
    until(early.exists, [holder, second], "the second serves as traced")
    served = json.loads(early.read_text())
    assert not (gate / "release").exists() and not results_in(out)  # the holder is still held
    assert served["matched"] and served["served_as_traced"] > 0, served
    assert served["counters"]["inductor_compiles"] == 0, served["counters"]
    # Its background compile waits for the holder (it may reach the lease after that record).
    until(lambda: log.count("another process is compiling") > 0, [second], "the second waits for the holder")
    (gate / "release").touch()
    log.finish()
    wait_all([holder])
    results = {r["counters"]["inductor_compiles"] for r in results_in(out)}
    assert results == {0, 3}, results  # the holder compiled the three pieces; the second, nothing
    assert all(r["matched"] for r in results_in(out))


@pytest.mark.inductor
def test_a_replica_exiting_while_the_lease_holder_compiles_does_not_wait_for_it(tmp_path, s3_server):
    """A short-lived process (a script, a health check) that leaves while another replica holds
    the lease exits at once: it would wait only to load what it never runs."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    out.mkdir()
    gate.mkdir()
    defaults = {"TESSERA_BACKGROUND_COMPILE": "1"}
    holder = member(out, tmp_path / "a", s3_server.url, "--hold", str(gate), **defaults)
    until((gate / "holder").exists, [holder], "the first replica holds the lease in its compile")
    leaving = member(out, tmp_path / "b", s3_server.url, "--exit-early", **defaults)
    log = Stderr(leaving)
    text = log.finish(timeout=300)  # it exits while the holder is held: no wait for the release
    assert not (gate / "release").exists() and holder.poll() is None
    assert "not waiting for the fleet's compile" in text or "another process is compiling" not in text
    early = json.loads((out / "early" / f"replica-{leaving.pid}.json").read_text())
    assert early["matched"] and early["counters"]["inductor_compiles"] == 0
    (gate / "release").touch()
    wait_all([holder])
    (result,) = results_in(out)
    assert result["matched"] and result["counters"]["inductor_compiles"] == 3
