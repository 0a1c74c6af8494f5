"""What the fleet tests share: real stores on loopback ports (redis-server, an S3 server) and
replicas as subprocesses (tests/run_fleet_member.py), raced and watched.

``make test`` installs redis-server when missing; the S3 server is moto's server mode (a dev
dependency), which speaks the S3 protocol over HTTP, conditional writes included.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "tessera-fleet"
# What a replica needs to reach the S3 server: any key works there.
S3_KEYS = {"AWS_ACCESS_KEY_ID": "fleet", "AWS_SECRET_ACCESS_KEY": "fleet", "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is installed by make test (apt-get install redis-server)"
        import redis

        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def pause(self) -> None:
        """Stop answering (SIGSTOP): connections are accepted, commands hang."""
        assert self.proc is not None, "redis-server is not running"
        self.proc.send_signal(signal.SIGSTOP)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server takes SIGTERM only once resumed
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None

    def client(self) -> redis.Redis:
        import redis

        return redis.Redis.from_url(self.url)


def member(out: Path, root: Path, remote: str | None, *args: str, **env: str) -> subprocess.Popen[str]:
    environment = dict(os.environ, TESSERA_CACHE_DIR=str(root), PYTHONPATH=str(ROOT))
    environment.pop("TESSERA_CACHE_REMOTE", None)
    environment.pop("TESSERA_CACHE_REMOTE_LEASES", None)
    if remote:
        environment["TESSERA_CACHE_REMOTE"] = remote
    environment.update(env)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.run_fleet_member", str(out), *args],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def results_in(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def wait_all(procs: list[subprocess.Popen[str]], timeout: float = 900) -> None:
    for proc in procs:
        _, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-3000:]


def until(done, procs: list[subprocess.Popen[str]], what: str, timeout: float = 300) -> None:
    """Poll ``done()`` until it holds; fail naming ``what`` if a replica fails or time runs out (a
    replica that exits cleanly has done its part: under load, one may finish before the others)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        assert all(p.poll() in (None, 0) for p in procs), f"a replica failed before {what}"
        time.sleep(0.02)


def release_together(barrier: Path, procs: list[subprocess.Popen[str]]) -> None:
    """Once every replica has started, let them all go at once (so they race for real)."""
    until(lambda: len(list(barrier.glob("ready.*"))) == len(procs), procs, "the replicas started")
    (barrier / "go").touch()


def race(tmp_path: Path, url: str | None, count: int, *args: str, **env: str) -> list[dict]:
    """``count`` replicas on ``url``, each with an empty local root, let go together; their
    results once all have exited."""
    out, barrier = tmp_path / "out", tmp_path / "barrier"
    out.mkdir(parents=True)
    barrier.mkdir()
    procs = [
        member(out, tmp_path / f"local{i}", url, "--barrier", str(barrier), *args, **env)
        for i in range(count)
    ]
    release_together(barrier, procs)
    wait_all(procs)
    return results_in(out)


def eight_then_a_ninth(tmp_path: Path, url: str, **env: str) -> list[dict]:
    """Eight Inductor replicas on an empty store compile the toy Llama's three distinct pieces
    (first, middle, last) once in all; a ninth, on an empty local root, compiles and traces nothing."""
    results = race(tmp_path / "eight", url, 8, **env)
    assert len(results) == 8 and all(r["matched"] for r in results)
    assert sum(r["counters"]["inductor_compiles"] for r in results) == 3, json.dumps(
        [r["counters"] for r in results]
    )
    (ninth,) = race(tmp_path / "ninth", url, 1, **env)
    assert ninth["matched"] and ninth["counters"]["inductor_compiles"] == 0
    assert ninth["counters"]["graphs_traced"] == 0 and ninth["warm_start"] is True
    return results


class Stderr:
    """A replica's stderr, read as it comes (a thread each), so a test can act on its log."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(proc.stderr or ()), daemon=True)
        self.thread.start()

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))

    def finish(self, timeout: float = 300) -> str:
        assert self.proc.wait(timeout=timeout) == 0, "".join(self.lines)[-3000:]
        self.thread.join(timeout=30)
        return "".join(self.lines)


class S3Server:
    """moto's S3 server on a loopback port, holding one bucket. Its objects live in its memory:
    a stop loses them, as a store that lost its data would."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.url = f"s3://{BUCKET}/fleet"
        self.env = {**S3_KEYS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> None:
        server = Path(sys.executable).parent / "moto_server"
        assert server.exists(), "moto's server is a dev dependency: pip install 'moto[server]'"
        self.proc = subprocess.Popen(
            [str(server), "-H", "127.0.0.1", "-p", str(self.port)],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:  # creating the bucket is the readiness check
                request = urllib.request.Request(f"{self.endpoint}/{BUCKET}", method="PUT")
                urllib.request.urlopen(request, timeout=5).close()
                return
            except OSError:
                assert self.proc.poll() is None, "moto_server exited"
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None

    def _bucket(self) -> Any:
        """The bucket under the tier's prefix, as the test (not a replica) reads and writes it."""
        from obstore.store import S3Store

        return S3Store(
            BUCKET,
            prefix="fleet",
            endpoint=self.endpoint,
            access_key_id=S3_KEYS["AWS_ACCESS_KEY_ID"],
            secret_access_key=S3_KEYS["AWS_SECRET_ACCESS_KEY"],
            region=S3_KEYS["AWS_REGION"],
            client_options={"allow_http": True},
        )

    def keys(self, prefix: str = "") -> list[str]:
        """The object names under the tier's prefix (``tessera/v1/...``) that start with ``prefix``."""
        import obstore

        return sorted(
            meta["path"] for batch in obstore.list(self._bucket(), prefix or None) for meta in batch
        )

    def read(self, name: str) -> bytes:
        import obstore

        return bytes(obstore.get(self._bucket(), name).bytes())

    def write(self, name: str, data: bytes) -> None:
        import obstore

        obstore.put(self._bucket(), name, data)

    def delete(self, name: str) -> None:
        import obstore

        obstore.delete(self._bucket(), name)
