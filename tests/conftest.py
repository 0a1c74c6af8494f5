"""Shared fixtures: a clean Dynamo and counters per test, a private cache root, test ops."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tessera
from tessera import _compat
from tests.fleet import RedisServer, S3Server


def _cached_compiler() -> None:
    """Inductor's kernels built through ccache for the whole suite and its child processes (CXX is
    inherited). Every Inductor test starts with empty Inductor caches and builds the same kernels
    as the tests before it; g++ is much of an Inductor test's CPU time (45 minutes is CI's bound
    on two cores). Below Inductor and tessera: both still compile, count and save as they would.
    Left alone when CXX is set or ccache is missing (make test installs it)."""
    real, ccache = shutil.which("g++"), shutil.which("ccache")
    if os.environ.get("CXX") or real is None or ccache is None:
        return
    store = Path(os.environ.get("CCACHE_DIR") or Path.home() / ".cache" / "tessera" / "test-ccache")
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # ccache would fail every build: g++ as it is
    if not os.access(store, os.W_OK):
        return
    os.environ["CCACHE_DIR"] = str(store)
    os.environ["TESSERA_TEST_REAL_CXX"] = real
    os.environ["CXX"] = str(Path(__file__).parent / "tools" / "cached-g++")
    # Kernels are built in each test's own directory: the directory left out of the hash (it only
    # names the debug info's directory), and the precompiled header Inductor includes accepted.
    os.environ["CCACHE_NOHASHDIR"] = "1"
    os.environ["CCACHE_SLOPPINESS"] = "pch_defines,time_macros,include_file_mtime,include_file_ctime"


_cached_compiler()


# silly::attention: a stand-in splitting op with a real and a fake implementation.
if not hasattr(torch.ops.silly, "attention"):
    torch.library.define("silly::attention", "(Tensor q, Tensor k, Tensor v) -> Tensor")

    @torch.library.impl("silly::attention", "CompositeExplicitAutograd")
    def _silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q * 0.5 + k.sin() + v

    @torch.library.register_fake("silly::attention")
    def _silly_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(q)


@pytest.fixture(autouse=True)
def _clean_state(request, tmp_path, monkeypatch):
    torch._dynamo.reset()
    tessera.counters.reset()
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("MODE", "BACKEND", "COMPILE_SIZES", "COMPILE_RANGES", "MAX_SIZE", "DISABLE_CACHE"):
        monkeypatch.delenv(f"TESSERA_{name}", raising=False)
    # Counters and records after a first call are exact only when every size compiled before it:
    # tests compile up front, and tests/test_background.py turns the background on where it tests it.
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "0")
    # And in their own process: a compile worker's start (torch and Inductor imported again, 5-10
    # s of CPU on two cores) in every child process of every test cost CI about 15 minutes. The
    # tests of compile workers ask for them; those on the defaults (test_defaults.py, the
    # "on_the_defaults" ones, a fleet serving while it compiles) set TESSERA_COMPILE_WORKERS=""
    # for the default, one worker where general artifacts compile in the background.
    monkeypatch.setenv("TESSERA_COMPILE_WORKERS", "0")
    if request.node.get_closest_marker("inductor") is None:
        yield
    else:
        # Inductor's own caches empty per test (as torch's tests do): a test that asserts what
        # tessera compiled or loaded must not pass on kernels an earlier test left behind. Child
        # processes inherit the directory through TORCHINDUCTOR_CACHE_DIR.
        with _compat.fresh_inductor_cache(str(tmp_path)):
            # The probe describes the machine, not a model: no test can pass on it, and every
            # graph and kernel cache stays empty. It saves each Inductor process of a test ~3 s.
            probe = request.getfixturevalue("_inductor_probe")
            shutil.copytree(probe, os.environ["TORCHINDUCTOR_CACHE_DIR"], dirs_exist_ok=True)
            yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def _inductor_probe(tmp_path_factory) -> Path:
    """Inductor's CPU probe (the vector-ISA test program it builds with g++: about 3 s on the
    2-core machine, in every process with an empty cache), built once, in a child: the probe's
    result is memoised per process."""
    seed = tmp_path_factory.mktemp("inductor-probe")
    subprocess.run(
        [sys.executable, "-c", "from torch._inductor import cpu_vec_isa; cpu_vec_isa.pick_vec_isa()"],
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(seed)},
        check=True,
        capture_output=True,
        timeout=300,
    )
    return seed


def silly_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Two calls of silly::attention with compiled work before, between and after."""
    y = (x @ w).relu()
    y = torch.ops.silly.attention(y, y, y)
    y = y * 2 + 1
    y = torch.ops.silly.attention(y, y, y)
    return y.sum(-1, keepdim=True) + y


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of the test's own on a loopback port."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_server(tmp_path, monkeypatch) -> Iterator[S3Server]:
    """An S3 server of the test's own on a loopback port, with one empty bucket; this process and
    the replicas it starts reach it through the AWS_* variables."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)  # the machine's own, which would win over ours
    server = S3Server(tmp_path)
    server.start()
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    yield server
    server.stop()
