"""A fleet starting at once: Inductor compiles in total and each replica's time to first output.

Eight replicas (processes, each with its own empty local cache root) against one Redis, next to
the same eight with no remote tier; and four torchrun ranks (gloo): sharing one machine's cache
root, then each with its own empty root (as on separate machines) with and without Redis.
JSON out. Needs ``redis-server`` on PATH and ``tessera[remote]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import as_installed, child_env, header

LAYERS = 4
WIDTH = 128


def member(out: str, barrier: str | None, distributed: bool) -> None:
    """One replica or rank: compile the toy Llama, run it, write what it cost."""
    start = time.time()
    import torch

    import tessera
    from tessera.models import toy_llama

    name = f"replica-{os.getpid()}"
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        name = f"rank-{dist.get_rank()}"
        if os.environ.get("FLEET_BENCH_ROOT_PER_RANK"):  # ranks as if on separate machines
            base = Path(os.environ["TESSERA_CACHE_DIR"])
            os.environ["TESSERA_CACHE_DIR"] = str(base / name)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / f"inductor-{name}")
    # Process start to here (the imports, as every replica makes them at once); the wait at the
    # barrier is left out of ``first_output_from_start``: it is the benchmark's, not the replica's.
    imported = time.time() - float(os.environ.get("FLEET_BENCH_LAUNCHED", start))
    if barrier:
        (Path(barrier) / f"ready.{os.getpid()}").touch()
        while not (Path(barrier) / "go").exists():
            time.sleep(0.01)
    start = time.time()
    model = toy_llama.build(num_layers=LAYERS, hidden_size=WIDTH, intermediate_size=2 * WIDTH)
    # FLEET_BENCH_EAGER: the baseline, the model itself (eager's first output, same start).
    eager = os.environ.get("FLEET_BENCH_EAGER") == "1"
    compiled = model if eager else tessera.compile(model, backend="inductor")
    with torch.no_grad():
        out_tensor = compiled(*toy_llama.example_inputs(16))
    first = time.time() - start
    if os.environ.get("FLEET_BENCH_FIRST_ONLY") == "1":  # timed to the first output alone
        report = {
            "first_output_seconds": first,
            "first_output_from_start": imported + first,
            "correct": _equal_to_eager(model, out_tensor),
            "counters": tessera.counters.snapshot(),
        }
        Path(out, f"{name}.json").write_text(json.dumps(report))
        os._exit(0)  # the trace beside eager is not waited for: the replica is done being timed
    if isinstance(compiled, tessera.CompiledModel):
        compiled.wait_ready()  # background compiles (serving as traced meanwhile) counted too
    ready = time.time() - start
    correct = _equal_to_eager(model, out_tensor)
    with torch.no_grad():
        out_tensor = compiled(*toy_llama.example_inputs(16))  # now by the compiled artifacts
    correct = correct and _equal_to_eager(model, out_tensor)
    report = {
        "first_output_seconds": first,
        "first_output_from_start": imported + first,
        "ready_seconds": ready,
        "correct": correct,
        "counters": tessera.counters.snapshot(),
    }
    Path(out, f"{name}.json").write_text(json.dumps(report))
    if distributed:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _equal_to_eager(model: Any, output: Any) -> bool:
    """Whether ``output`` is the model's own for the replica's call (16 tokens)."""
    import torch

    from tessera.models import toy_llama

    with torch.no_grad():
        return bool(torch.allclose(output, model(*toy_llama.example_inputs(16)), atol=1e-4, rtol=1e-4))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _summary(out: Path) -> dict[str, Any]:
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    firsts = [r["first_output_seconds"] for r in reports]
    return {
        "processes": len(reports),
        "all_correct": all(r["correct"] for r in reports),
        "inductor_compiles_total": sum(r["counters"]["inductor_compiles"] for r in reports),
        "first_output_seconds": sorted(round(f, 2) for f in firsts),
        "first_output_median": statistics.median(firsts),
        "first_output_max": max(firsts),
        "first_output_from_start_seconds": sorted(round(r["first_output_from_start"], 2) for r in reports),
        "first_output_from_start_median": statistics.median(r["first_output_from_start"] for r in reports),
        "ready_seconds": sorted(round(r.get("ready_seconds", 0.0), 2) for r in reports),
    }


def replicas(
    scratch: Path, count: int, remote: str | None, eager: bool = False, first_only: bool = False
) -> dict[str, Any]:
    """``count`` replicas started together (a barrier after their imports); ``first_only``: each
    exits at its first output."""
    out, barrier = scratch / "out", scratch / "barrier"
    out.mkdir()
    barrier.mkdir()
    procs = []
    for i in range(count):
        env = child_env(TESSERA_CACHE_DIR=str(scratch / f"local{i}"))
        env["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / f"inductor{i}")  # a fresh node each
        env.pop("TESSERA_CACHE_REMOTE", None)
        if remote:
            env["TESSERA_CACHE_REMOTE"] = remote
        if eager:
            env["FLEET_BENCH_EAGER"] = "1"
        if first_only:
            env["FLEET_BENCH_FIRST_ONLY"] = "1"
        env["FLEET_BENCH_LAUNCHED"] = repr(time.time())
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.fleet",
            "--member",
            str(out),
            "--barrier",
            str(barrier),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        )
    while len(list(barrier.glob("ready.*"))) < count:
        failed = next((proc for proc in procs if proc.poll() is not None), None)
        if failed is not None:  # it will never be ready: say why instead of waiting forever
            raise RuntimeError(f"a replica exited before the start:\n{failed.communicate()[1][-3000:]}")
        time.sleep(0.05)
    (barrier / "go").touch()
    for proc in procs:
        _, err = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"replica failed:\n{err[-3000:]}")
    return _summary(out)


def ranks(scratch: Path, count: int, remote: str | None, per_rank_roots: bool) -> dict[str, Any]:
    """``count`` ranks under torchrun: one machine's cache root shared by all, or a root per rank
    (as ranks on separate machines would have), with or without the Redis tier."""
    out = scratch / "out"
    out.mkdir()
    env = child_env(TESSERA_CACHE_DIR=str(scratch / "root"), TORCHINDUCTOR_CACHE_DIR=str(scratch / "ind"))
    env.pop("TESSERA_CACHE_REMOTE", None)
    if remote:
        env["TESSERA_CACHE_REMOTE"] = remote
    if per_rank_roots:
        env["FLEET_BENCH_ROOT_PER_RANK"] = "1"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--nproc-per-node", str(count), "--master-port", str(_free_port())]
    cmd += ["-m", "benchmarks.fleet", "--member", str(out), "--distributed"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{proc.stderr[-3000:]}")
    return _summary(out)


def _flush(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"FLUSHALL\r\n")
        if not conn.recv(16).startswith(b"+OK"):
            raise RuntimeError("redis FLUSHALL failed")


def _wait_for_redis(port: int, server: subprocess.Popen[bytes]) -> None:
    """Until redis-server accepts connections (or exits)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--member")
    parser.add_argument("--barrier")
    parser.add_argument("--distributed", action="store_true")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args(argv)
    if args.member:
        member(args.member, args.barrier, args.distributed)
        return 0
    binary = shutil.which("redis-server")
    if binary is None:
        print("fleet benchmark: redis-server is not on PATH (apt-get install redis-server)", file=sys.stderr)
        return 2
    as_installed()
    result: dict[str, Any] = {
        **header("fleet"),
        "model": {"family": "toy_llama", "layers": LAYERS, "width": WIDTH},
    }
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        port = _free_port()
        server = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            cwd=scratch,
            stdout=subprocess.DEVNULL,
        )
        try:
            _wait_for_redis(port, server)
            url = f"redis://127.0.0.1:{port}/0"
            runs: list[tuple[str, Callable[[Path], Any]]] = [
                ("replicas_with_redis", lambda d: replicas(d, args.replicas, url)),
                ("replicas_without_remote", lambda d: replicas(d, args.replicas, None)),
                ("ranks_one_machine_cache", lambda d: ranks(d, args.ranks, None, False)),
                ("ranks_root_per_rank_with_redis", lambda d: ranks(d, args.ranks, url, True)),
                ("ranks_root_per_rank_without_remote", lambda d: ranks(d, args.ranks, None, True)),
            ]
            for name, runner in runs:
                if name.startswith("ranks"):  # a fresh store: ranks do not find the replicas' entries
                    _flush(port)
                (scratch / name).mkdir()
                result[name] = runner(scratch / name)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
