"""The start-up benchmarks' children run end to end (on the eager backend: what they measure is
timing, which no test asserts, but a child that raises leaves a benchmark with no result)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import child_env


def _child(tmp_path: Path, *args: str) -> dict[str, object]:
    env = child_env(
        TESSERA_CACHE_DIR=str(tmp_path / "tessera"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        TESSERA_BACKEND="eager",
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


def test_gil_waits_reads_the_threads_of_a_dump_but_the_serving_and_the_waiting_ones() -> None:
    from benchmarks.gil_waits import _threads, _where

    dump = (
        "Timeout (0:00:00.023000)!\n"
        "Thread 0x00000000000000aa (most recent call first):\n"
        '  File "/usr/lib/python3.11/site-packages/torch/fx/graph_module.py", line 143 in _exec_with_source\n'
        '  File "/repo/tessera/cache/key.py", line 151 in graph_signature\n'
        "\n"
        "Thread 0x00000000000000bb (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 331 in wait\n'
        '  File "/repo/tessera/pacing.py", line 135 in give_way\n'
        "\n"
        "Thread 0x00000000000000cc (most recent call first):\n"
        '  File "/repo/serve.py", line 9 in <module>\n'
    )
    threads = _threads(dump, main=0xCC)
    held = ["torch/fx/graph_module.py:143 _exec_with_source", "tessera/cache/key.py:151 graph_signature"]
    assert threads == [held], threads
    assert _where(["ast.py:272 walk", *threads[0]]) == "torch/fx/graph_module.py:143 _exec_with_source"


def test_drop_costs_tessera_child_frees_the_model_it_drops(tmp_path: Path) -> None:
    result = _child(tmp_path, "benchmarks.drop_cost", "--child", "tessera", "--layers", "1")
    assert result["freed"] is True, result  # by reference counting and the one walk, no gc.collect()
    assert isinstance(result["frozen_objects"], int) and result["frozen_objects"] > 0  # the heap froze
    assert isinstance(result["drop_s"], float)
