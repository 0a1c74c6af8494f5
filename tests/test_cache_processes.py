"""The cache across processes: cold then warm, eight at once, edited sources, the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.child import ROOT, child_env, run_toy

pytestmark = pytest.mark.slow  # several processes per test: not in make test-fast


def cli(cache: Path, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: PLW1510 (return codes are asserted)
        [sys.executable, "-m", "tessera", "cache", *args],
        cwd=cwd,
        env=child_env(cache),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.inductor
def test_cold_then_warm_process(tmp_path):
    cache = tmp_path / "cache"
    cold = run_toy(cache, tmp_path / "cold.pt", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-cold"))
    # A warm process on a fresh machine: Inductor's own cache directory is empty.
    warm = run_toy(cache, tmp_path / "warm.pt", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor-warm"))
    assert not (tmp_path / "inductor-warm").exists()  # nothing compiled, not even a C++ kernel
    assert cold["counters"]["inductor_compiles"] > 0
    assert warm["counters"]["inductor_compiles"] == 0
    assert warm["counters"]["graphs_traced"] == 0  # the whole-model artifact skips Dynamo
    assert warm["warm_start"] is True
    # The physical limit: no Dynamo tracer, no Inductor, not even sympy in the warm process.
    assert warm["modules"] == dict.fromkeys(warm["modules"], False), warm["modules"]
    assert warm["counters"]["cache_hits"] == warm["counters"]["backend_compilations"] > 0
    cold_out, warm_out = torch.load(tmp_path / "cold.pt"), torch.load(tmp_path / "warm.pt")
    assert cold_out.keys() == warm_out.keys()
    assert all(torch.equal(cold_out[n], warm_out[n]) for n in cold_out)


# Inductor only: the eager compiler's run of the same race added 20 s of CI and nothing Inductor's does not.
@pytest.mark.parametrize("backend", [pytest.param("inductor", marks=pytest.mark.inductor)])
def test_eight_processes_at_once_then_a_ninth_compiles_nothing(tmp_path, backend):
    """The eager run is quick, so its processes race on creating the entry's files themselves."""
    cache, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    args = ["--layers", "1", "--compile-sizes", "", "--backend", backend, "--barrier", str(barrier)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.run_toy", str(tmp_path / f"out{i}.pt"), *args],
            cwd=ROOT,
            env=child_env(cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    deadline = time.monotonic() + 300
    while len(list(barrier.glob("ready.*"))) < 8:
        assert time.monotonic() < deadline, "processes never became ready"
        assert all(p.poll() is None for p in procs), "a process died before the start barrier"
        time.sleep(0.05)
    (barrier / "go").touch()
    results = [p.communicate(timeout=600) for p in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-3000:]
        assert "CacheDamagedWarning" not in err
    # One process compiles while the others wait on the entry's compile lock and then load:
    # the two compiled pieces of the one-layer toy are compiled once in all.
    counts = [json.loads(out.strip().splitlines()[-1])["counters"] for out, _ in results]
    compiles = "inductor_compiles" if backend == "inductor" else "eager_compiles"
    assert sum(c[compiles] for c in counts) == 2, counts
    verified = cli(cache, "verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    ninth = run_toy(
        cache, tmp_path / "ninth.pt", "--layers", "1", "--compile-sizes", "", "--backend", backend
    )
    # The ninth loads every artifact the eight made: its own backend's compile counter says so.
    assert ninth["counters"][compiles] == 0 and ninth["counters"]["graphs_traced"] <= 1, ninth
    assert ninth["counters"]["cache_hits"] == ninth["counters"]["backend_compilations"] > 0, ninth
    if backend == "inductor":
        assert ninth["counters"]["graphs_traced"] == 0  # whole-model artifact: no Dynamo either
    first = torch.load(tmp_path / "out0.pt")
    for i in range(1, 8):
        other = torch.load(tmp_path / f"out{i}.pt")
        assert all(torch.equal(first[n], other[n]) for n in first)


MODEL_TOP = """
import torch
from helpers import mix

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return mix(x @ self.w)
"""

SCRIPT = """
import json, torch, tessera
from top import Model
compiled = tessera.compile(Model(), backend="eager")
with torch.no_grad():
    compiled(torch.ones(3, 4))
print(json.dumps({"cache_dir": str(compiled.cache_dir)}))
"""


def test_editing_a_file_the_forward_calls_misses_and_explain_names_it(tmp_path):
    src, cache = tmp_path / "src", tmp_path / "cache"
    src.mkdir()
    (src / "top.py").write_text(MODEL_TOP)
    (src / "helpers.py").write_text("def mix(x):\n    return x.relu() + 1\n")
    (src / "script.py").write_text(SCRIPT)

    def run() -> str:
        env = child_env(cache)
        env["PYTHONPATH"] = f"{src}{os.pathsep}{ROOT}"
        proc = subprocess.run(  # noqa: PLW1510 (return codes are asserted)
            [sys.executable, "script.py"], cwd=src, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])["cache_dir"]

    first = run()
    assert run() == first  # unchanged sources: the same entry
    (src / "helpers.py").write_text("def mix(x):\n    return x.relu() + 2\n")
    second = run()
    assert second != first
    explained = cli(cache, "explain")
    assert explained.returncode == 0, explained.stderr
    assert "source file helpers.py: content changed" in explained.stdout, explained.stdout
    assert "return x.relu() + 2" in explained.stdout
    assert "top.py" not in explained.stdout.split("differences:")[1]


def test_cli_ls_verify_clear_prune(tmp_path):
    cache = tmp_path / "cache"
    run_toy(cache, tmp_path / "a.pt", "--backend", "eager", "--layers", "1")
    listed = cli(cache, "ls")
    assert listed.returncode == 0 and "model" in listed.stdout and "1 entry" in listed.stdout
    assert cli(cache, "verify").returncode == 0
    index = next(cache.glob("*/rank_0_0/model/index.py"))
    index.write_text("{'version': 1, 'entries': [")
    damaged = cli(cache, "verify")
    assert damaged.returncode == 1 and "index.py" in damaged.stdout
    pruned = cli(cache, "prune", "--max-size", "0")
    assert pruned.returncode == 0 and "1 entry removed" in pruned.stdout
    assert not list(cache.glob("*/rank_*/*"))
    run_toy(cache, tmp_path / "b.pt", "--backend", "eager", "--layers", "1")
    cleared = cli(cache, "clear")
    assert cleared.returncode == 0 and "removed 1 entries" in cleared.stdout
    assert cli(cache, "prune", "--max-size", "lots").returncode == 2


def test_prune_never_removes_an_entry_in_use(tmp_path):
    from tessera.cache.tools import find_entries, prune

    cache = tmp_path / "cache"
    run_toy(cache, tmp_path / "a.pt", "--backend", "eager", "--layers", "1")
    (entry,) = find_entries(cache)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl,sys;f=open(sys.argv[1],'a+b');"
            "fcntl.flock(f,fcntl.LOCK_SH);print('held',flush=True);sys.stdin.read()",
            str(entry / ".inuse"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    try:
        assert prune(cache, 0) == [] and entry.exists()
    finally:
        holder.communicate("")
    assert prune(cache, 0) == [entry] and not entry.exists()


# -- liveness: what clear and prune may remove while other processes run -------------------------
def _paused_writer(cache: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process caught in the middle of a write into its entry: alive, its temp file complete."""
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.run_writer", str(cache)],
        cwd=ROOT,
        env=child_env(cache),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    line = writer.stdout.readline().strip()  # returns once the writer is mid-write (or died)
    assert line, writer.communicate()[1][-3000:]
    return writer, Path(line)


def _can_unshare_pids() -> bool:
    try:
        probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, check=False)
    except OSError:
        return False
    return probe.returncode == 0


@pytest.mark.parametrize("where", ["clock skew", "another pid namespace"])
def test_clear_keeps_a_live_writers_temp_file_and_removes_a_dead_ones(tmp_path, where):
    """A writer is alive while it holds its lock, whatever its pid looks like from the pruner:
    a cache on a file server whose clock lags (the temp file looks older than the process), or
    a pruner in another container (the writer's pid does not exist there)."""
    from tessera.cache.tools import clear, prune, stray_temp_files

    cache = tmp_path / "cache"
    writer, temp = _paused_writer(cache)
    try:
        if where == "clock skew":
            an_hour_ago = time.time() - 3600
            os.utime(temp, (an_hour_ago, an_hour_ago))
            assert stray_temp_files(cache) == []
            clear(cache)
        else:
            if not _can_unshare_pids():
                pytest.skip("needs unshare --pid (root or user namespaces)")
            cleared = subprocess.run(  # noqa: PLW1510 (return codes are asserted)
                ["unshare", "--pid", "--fork", sys.executable, "-m", "tessera", "cache", "clear"],
                cwd=ROOT,
                env=child_env(cache),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert cleared.returncode == 0, cleared.stderr[-3000:]
        assert temp.exists()
    finally:
        out, err = writer.communicate("go\n", timeout=60)
    assert writer.returncode == 0 and "Warning" not in err, err[-3000:]
    assert Path(out.split()[-1]).read_text() == "written by a live process\n"

    killed, left = _paused_writer(cache)  # the same writer killed mid-write: its temp file is stray
    killed.kill()
    killed.communicate(timeout=60)
    assert stray_temp_files(cache) == [left]
    assert prune(cache, 1 << 40) == [] and not left.exists()
    assert stray_temp_files(cache) == []


def test_prune_racing_processes_that_compile_and_load(tmp_path):
    """`cache prune --max-size 0` over and over, from another pid namespace where the machine
    allows (a pruner in another container), while four processes compile and load: two per
    entry, two rounds each, one entry by the eager compiler and one whose compiler saves files.
    No damage reported, no file missing, no crash, no work lost, results equal to eager (run_toy
    checks them), and the cache verifies afterwards."""
    from tessera.cache.tools import stray_temp_files, verify

    cache, stop, rounds = tmp_path / "cache", tmp_path / "stop", 2
    backends = ["eager", "tests.custom_compiler:CodeSavingCompiler"]

    def start(lane: int, round_: int) -> subprocess.Popen[str]:
        name = tmp_path / f"lane{lane}-{round_}"
        args = ["--backend", backends[lane % 2], "--layers", "1", "--sizes", "3,9", "--compile-sizes", ""]
        with open(f"{name}.err", "w") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "tests.run_toy", f"{name}.pt", *args],
                cwd=ROOT,
                env=child_env(cache),
                stdout=subprocess.DEVNULL,
                stderr=err,
                text=True,
            )

    namespace = ["unshare", "--pid", "--fork"] if _can_unshare_pids() else []
    pruner = subprocess.Popen(
        [*namespace, sys.executable, "-m", "tests.run_pruner", str(cache), str(stop)],
        cwd=ROOT,
        env=child_env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    running = {lane: start(lane, 0) for lane in range(4)}
    started = dict.fromkeys(running, 1)
    finished: list[tuple[str, int]] = []
    deadline = time.monotonic() + 600
    try:
        while running:
            assert time.monotonic() < deadline, "the processes never finished"
            assert pruner.poll() is None, pruner.communicate()[1][-3000:]
            for lane, proc in list(running.items()):
                if proc.poll() is None:
                    continue
                finished.append((f"lane{lane}-{started[lane] - 1}", proc.returncode))
                if started[lane] < rounds:
                    running[lane] = start(lane, started[lane])
                    started[lane] += 1
                else:
                    del running[lane]
            if running:  # woken by a process that ends, or after a moment to look again
                with contextlib.suppress(subprocess.TimeoutExpired):
                    next(iter(running.values())).wait(timeout=0.05)
    finally:
        stop.touch()
        out, err = pruner.communicate(timeout=120)
    assert pruner.returncode == 0, err[-3000:]
    for name, returncode in finished:
        err = (tmp_path / f"{name}.err").read_text()
        assert returncode == 0, err[-3000:]
        assert "Warning" not in err and "Traceback" not in err, err[-3000:]
    assert len(finished) == 4 * rounds
    assert json.loads(out)["removed"] > 0, "prune never found an unused entry: no race was run"
    assert verify(cache) == []
    assert stray_temp_files(cache) == []
