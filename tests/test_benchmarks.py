"""The start-up benchmarks' children run end to end (on the eager backend: what they measure is
timing, which no test asserts, but a child that raises leaves a benchmark with no result)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import child_env


def _child(tmp_path: Path, *args: str, **extra: str) -> dict[str, object]:
    env = child_env(
        TESSERA_CACHE_DIR=str(tmp_path / "tessera"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        TESSERA_BACKEND="eager",
        **extra,
    )
    done = subprocess.run(
        [sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_first_minutes_tessera_child_reports_its_stream_and_when_its_trace_landed(tmp_path: Path) -> None:
    result = _child(
        tmp_path, "benchmarks.first_minute", "--child", "toy4", "tessera", "--seconds", "1", "--gap", "0.01"
    )
    calls = result["calls"]
    assert isinstance(calls, list) and calls
    assert {call["stage"] for call in calls} <= {"eager", "ready"}
    landed = result["traces_landed_s"]
    assert isinstance(landed, dict) and list(landed) == ["trace 1"], landed
    assert 0 < landed["trace 1"] < 600
    assert len(result["outputs"]) == 4  # type: ignore[arg-type]
    # The full collection the child runs before its model (every process pays it there) is
    # recorded, and is not counted as one of the stream's.
    from benchmarks.first_minute import _long_collections

    collections = result["collections"]
    assert isinstance(collections, list)
    assert any(gen == 2 and where == "MainThread" and ms > 1 for _, ms, gen, where in collections)
    before = [c for c in collections if c[0] < result["stream_start"]]  # type: ignore[operator]
    assert before and "gen2" not in _long_collections({**result, "collections": before})


def test_eager_noises_compiled_child_counts_its_calls(tmp_path: Path) -> None:
    args = ("--model", "toy4", "--seconds", "0.5", "--child", "1", "on", "tessera")
    result = _child(tmp_path, "benchmarks.eager_noise", *args)
    assert result["impl"] == "tessera" and result["threads"] == 1
    took = result["took"]
    assert isinstance(took, list) and len(took) == result["calls"] > 0
