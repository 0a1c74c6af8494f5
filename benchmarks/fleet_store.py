"""A fleet on an object store: what each replica asks of the store at start, and what it costs.

``python -m benchmarks.fleet_store [--replicas 8]``. An S3 server (moto's, on a loopback port)
holds one empty bucket; the tier is ``cache_remote="s3://bucket/fleet"`` with the store alone
(leases by conditional writes). Runs, each replica a process with its own empty local root and
Inductor cache (a fresh node), the 4-layer width-128 toy Llama on Inductor:

- ``cold_fleet``: N replicas started together on the empty bucket;
- ``warm_replica``: one more, after them;
- ``store_hanging``: one more while the store accepts connections and answers nothing (the
  server stopped with SIGSTOP): the fault budget, then a local compile;
- ``without_remote``: N replicas with no remote tier (the baseline: each compiles everything);
- ``eager_fleet``: N processes of the model itself, started together (eager's first output, the
  baseline of ``first_output_max_over_eager``).

For each replica: the store requests it made (all, and PUTs), the blob bytes it read and wrote,
its Inductor compiles, its seconds to first output and to ready (every compile done: without a
remote tier a replica serves as traced while it compiles). docs/fleet-at-scale.md scales these up.
Needs ``tessera[objectstore]`` and moto's server (the dev extra).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks import as_installed, header
from benchmarks.fleet import LAYERS, WIDTH, _free_port, replicas

BUCKET = "tessera-bench"
KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}


def _start_store(scratch: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    server = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen(
        [str(server), "-H", "127.0.0.1", "-p", str(port)],
        cwd=scratch,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            request = urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")
            urllib.request.urlopen(request, timeout=5).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    "moto_server did not start (pip install 'moto[s3]' flask flask-cors)"
                ) from None
            time.sleep(0.05)


def _per_replica(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(out.glob("*.json")):
        report = json.loads(path.read_text())
        c = report["counters"]
        rows.append(
            {
                "requests": c["remote_requests"],
                "writes": c["remote_writes"],
                "bytes_read": c["remote_bytes_read"],
                "bytes_written": c["remote_bytes_written"],
                "inductor_compiles": c["inductor_compiles"],
                "served_eagerly": c["served_eagerly"],
                "first_output_seconds": round(report["first_output_seconds"], 2),
                "first_output_from_start": round(report["first_output_from_start"], 2),
                "ready_seconds": round(report.get("ready_seconds", 0.0), 2),  # 0.0: stopped at the first
                "correct": report["correct"],
            }
        )
    return rows


def _run(scratch: Path, name: str, count: int, remote: str | None, eager: bool = False) -> dict[str, Any]:
    where = scratch / name
    where.mkdir()
    summary = replicas(where, count, remote, eager)
    rows = _per_replica(where / "out")
    summary["replicas"] = rows
    if remote:
        summary["requests_total"] = sum(r["requests"] for r in rows)
        summary["writes_total"] = sum(r["writes"] for r in rows)
        summary["bytes_read_total"] = sum(r["bytes_read"] for r in rows)
        summary["bytes_written_total"] = sum(r["bytes_written"] for r in rows)
        summary["requests_median"] = statistics.median(r["requests"] for r in rows)
    print(f"{name}: {json.dumps({k: v for k, v in summary.items() if k != 'replicas'})}", file=sys.stderr)
    return summary


def _over_eager(eager: dict[str, Any], run: dict[str, Any]) -> dict[str, float]:
    """Each replica's first output against eager's median, two ways: from the barrier (the model
    built, wrapped and called: tessera's own imports and set-up against eager's nothing), and from
    process start (acceptance 1's measure: the process's imports too, the barrier's wait left out).
    eager_fleet's own ratios are the machine's noise."""
    ratios = {}
    for key, median in (
        ("first_output_seconds", eager["first_output_median"]),
        ("first_output_from_start", eager["first_output_from_start_median"]),
    ):
        firsts = [r[key] for r in run["replicas"]]
        name = key.removesuffix("_seconds")
        ratios[f"{name}_max_over_eager"] = round(max(firsts) / median, 3)
        ratios[f"{name}_median_over_eager"] = round(statistics.median(firsts) / median, 3)
    return ratios


def _first_output_rounds(scratch: Path, count: int, url: str, rounds: int) -> dict[str, Any]:
    """Acceptance 3's first outputs, paired: ``rounds`` times, ``count`` eager processes and
    ``count`` cold replicas (an empty prefix of the store each round), one fleet after the other in
    alternating order, each process stopped at its first output. A single fleet pair is noise on a
    shared 2-core machine (eager's own slowest replica is up to 2.5x its median); the median of the
    rounds' ratios is the figure."""
    rows = []
    for i in range(rounds):
        runs = {}
        for eager in (True, False) if i % 2 == 0 else (False, True):
            where = scratch / f"first_{i}_{'eager' if eager else 'tessera'}"
            where.mkdir()
            remote = None if eager else f"{url}-first-{i}"
            run = replicas(where, count, remote, eager, first_only=True)
            run["replicas"] = _per_replica(where / "out")
            runs["eager" if eager else "tessera"] = run
        eager_run, tessera_run = runs["eager"], runs["tessera"]
        rows.append(
            {
                "eager_from_start": eager_run["first_output_from_start_seconds"],
                "tessera_from_start": tessera_run["first_output_from_start_seconds"],
                "eager_from_barrier": eager_run["first_output_seconds"],
                "tessera_from_barrier": tessera_run["first_output_seconds"],
                "all_correct": eager_run["all_correct"] and tessera_run["all_correct"],
                **{k: v for k, v in _over_eager(eager_run, tessera_run).items()},
            }
        )
        print(f"first output round {i}: {json.dumps(rows[-1])}", file=sys.stderr)
    keys = [k for k in rows[0] if k.endswith("_over_eager")]
    return {
        "rounds": rows,
        "median_of_rounds": {k: statistics.median(r[k] for r in rows) for k in keys},
        "all_correct": all(r["all_correct"] for r in rows),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--no-baseline", action="store_true", help="skip the replicas without a remote tier")
    parser.add_argument(
        "--first-output-rounds", type=int, default=5, help="paired fleets timed to the first output (0: none)"
    )
    args = parser.parse_args(argv)
    as_installed()
    result: dict[str, Any] = {
        **header("fleet_store"),
        "model": {"family": "toy_llama", "layers": LAYERS, "width": WIDTH},
        "store": "moto S3 server on loopback; the store alone (leases by conditional writes)",
        "timeout_seconds": float(os.environ.get("TESSERA_REMOTE_TIMEOUT_SECONDS", "5")),
    }
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        server, endpoint = _start_store(scratch)
        os.environ.update(KEYS, AWS_ENDPOINT_URL=endpoint)
        url = f"s3://{BUCKET}/fleet"
        try:
            # Eager's first output with as many processes starting at once on this machine: the
            # baseline each replica's first output is compared with.
            result["eager_fleet"] = _run(scratch, "eager_fleet", args.replicas, None, eager=True)
            result["cold_fleet"] = _run(scratch, "cold_fleet", args.replicas, url)
            result["warm_replica"] = _run(scratch, "warm_replica", 1, url)
            server.send_signal(signal.SIGSTOP)
            try:
                result["store_hanging"] = _run(scratch, "store_hanging", 1, url)
            finally:
                server.send_signal(signal.SIGCONT)
            if args.first_output_rounds:
                result["first_output_rounds"] = _first_output_rounds(
                    scratch, args.replicas, url, args.first_output_rounds
                )
            if not args.no_baseline:
                result["without_remote"] = _run(scratch, "without_remote", args.replicas, None)
            for run in ("eager_fleet", "cold_fleet", "warm_replica", "without_remote"):
                if run in result:
                    result[run].update(_over_eager(result["eager_fleet"], result[run]))
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
