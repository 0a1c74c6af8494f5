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
    stops = result["worker_stops"]  # the workers' stops for served calls (tessera/worker_pause.py)
    assert isinstance(stops, int) and stops >= 0
    # The full collection the child runs before its model (every process pays it there) is
    # recorded, and is not counted as one of the stream's.
    from benchmarks.first_minute import _long_collections

    collections = result["collections"]
    assert isinstance(collections, list)
    assert any(gen == 2 and where == "MainThread" and ms > 1 for _, ms, gen, where in collections)
    before = [c for c in collections if c[0] < result["stream_start"]]  # type: ignore[operator]
    assert before and "gen2" not in _long_collections({**result, "collections": before})


SPIN = """if True:
    import threading, time
    from benchmarks import gil_clock
    waited = gil_clock.reader()
    stop = time.perf_counter() + 0.5

    def spin():
        while time.perf_counter() < stop:
            pass

    before = waited()
    thread = threading.Thread(target=spin)
    thread.start()
    spin()  # both threads want the GIL all along: each waits for about half of it
    thread.join()
    print(waited() - before)
"""


def test_the_gil_clock_times_a_threads_waits_and_first_minute_splits_its_slow_calls_by_them(
    tmp_path: Path,
) -> None:
    from benchmarks import gil_clock
    from benchmarks.first_minute import _cause, _compare

    preload = gil_clock.preload_env(gil_clock.build(tmp_path))
    done = subprocess.run(
        [sys.executable, "-c", SPIN],
        env=child_env(**preload),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert 0.05 < float(done.stdout) < 2, done.stdout  # seconds (about 0.25), not a count or garbage
    assert gil_clock.reader() is None  # not preloaded in this process
    args = ("--child", "toy4", "eager", "--seconds", "0.5", "--gap", "0.01")
    calls = _child(tmp_path, "benchmarks.first_minute", *args, **preload)["calls"]
    assert isinstance(calls, list) and calls
    assert all(0 <= call["gil_late"] < 1 and 0 <= call["gil_in"] < 1 for call in calls), calls[:3]
    median = 0.002
    assert _cause({"seconds": 0.009, "late": 0.004, "gil_late": 0.003, "gil_in": 0.001}, median) == (
        "late_for_the_gil"
    )
    assert _cause({"seconds": 0.0055, "late": 0.003, "gil_late": 0.0005, "gil_in": 0.0}, median) == (
        "late_for_a_core"
    )
    assert (
        _cause({"seconds": 0.007, "late": 0.0002, "gil_late": 0.0, "gil_in": 0.004}, median) == "gil_in_call"
    )
    assert _cause({"seconds": 0.006, "late": 0.0002, "gil_late": 0.0, "gil_in": 0.0}, median) == "on_its_core"
    # The comparison counts the clocked calls by cause, and says nothing of causes unclocked.
    eager = {"first_output": 1, "steady_median": 1, "outputs": [[1.0]]}
    eager["calls"] = [{"at": 0.1, "size": 1, "seconds": median, "late": 0.0, "stage": "eager"}] * 3
    slow = {**eager["calls"][0], "seconds": 0.01, "gil_late": 0.0, "gil_in": 0.006}
    ours = {**eager, "calls": [slow] * 3, "seconds_to_traced": None, "seconds_to_ready": None}
    ours["traces_landed_s"] = {}
    compared = _compare(eager, ours)
    assert compared["slow_call_causes"]["gil_in_call"] == 3 and compared["slow_calls"][0][3:6] == [
        0.0,
        0.0,
        6.0,
    ]
    unclocked = {
        **ours,
        "calls": eager["calls"][:1] + [{k: v for k, v in slow.items() if k[:3] != "gil"}] * 2,
    }
    assert "slow_call_causes" not in _compare(eager, unclocked)


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


def test_trace_gaps_times_the_events_of_the_paced_threads(tmp_path: Path) -> None:
    env = child_env(
        TESSERA_CACHE_DIR=str(tmp_path / "tessera"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        TESSERA_BACKEND="eager",
    )
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.trace_gaps", "--model", "toy4", "--min-ms", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    # At 0 ms every pair of events is a gap: thousands, from the paced trace (its Dynamo frames).
    assert result["gaps"] > 1000, result["gaps"]
    longest = [gap["ms"] for gap in result["longest"]]
    assert longest == sorted(longest, reverse=True) and len(longest) == 25
    assert any("_dynamo" in where for gap in result["longest"] for where in gap["next_event_stack"])
