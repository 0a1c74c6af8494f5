"""The cache across processes: cold then warm, eight at once, edited sources, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.child import ROOT, child_env, run_toy


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


@pytest.mark.parametrize("backend", [pytest.param("inductor", marks=pytest.mark.inductor), "eager"])
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
