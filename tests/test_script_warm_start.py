"""Warm starts of a model defined in the script that runs it (``__main__``, issue 32).

Each test writes a script whose forward reads the script's own globals (a tensor, numbers, a dict,
module aliases, helpers, a nested function) and runs it in fresh processes on one cache: the first
traces, the next starts warm, tracing nothing, with eager's numbers at sizes the first never saw.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import tessera
from tessera.cache.entry import CacheEntry
from tessera.cache.refusal import Refused
from tessera.trace import model_artifact as artifact, portable
from tests.child import child_env

SCRIPT = '''
"""A model served by the script that defines it: its forward reads this script's globals."""

import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import tessera

SCALE = torch.full((8,), float(os.environ.get("SCALE", "0.5")))  # a graph input: read at call time
OFFSET = 3
CFG = {"k": float(os.environ.get("CFG_K", "2.0"))}  # baked into the graph


def make_leaky(slope):
    def leaky(x):
        return torch.where(x > 0, x, x * slope)

    return leaky


LEAKY = make_leaky(float(os.environ.get("SLOPE", "0.1")))  # its closure cell is baked in


def helper(x, bias=0.25):
    return LEAKY(x) * CFG["k"] + bias


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 64).reshape(8, 8), requires_grad=False)

    def forward(self, x):
        return helper(F.relu(x @ self.w) * SCALE) + OFFSET + np.pi + math.e


def forward(x, w):
    return helper(F.silu(x @ w) - SCALE) * OFFSET + np.e


def main():
    kind, backend = sys.argv[1], sys.argv[2]
    sizes = [int(n) for n in sys.argv[3].split(",")]
    w = torch.linspace(-1, 1, 64).reshape(8, 8)
    model, extra = (Model(), ()) if kind == "module" else (forward, (w,))
    compiled = tessera.compile(model, backend=backend)
    error = 0.0
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 8)
            got, want = compiled(x, *extra), model(x, *extra)
            torch.testing.assert_close(got, want)
            error = max(error, (got - want).abs().max().item())
    report = {
        "error": error,
        "warm_start": compiled.warm_start,
        "refused": compiled.warm_start_refused,
        "graphs_traced": tessera.counters.snapshot()["graphs_traced"],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
'''


def _run(command: list[str], cwd: Path, cache: Path, **env: str) -> dict[str, Any]:
    """One fresh process; the JSON report it prints last."""
    proc = subprocess.run(
        command,
        cwd=cwd,
        env=child_env(cache, **env),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    return script


def _assert_cold_then_warm(cold: dict[str, Any], warm: dict[str, Any]) -> None:
    assert cold["warm_start"] is False and cold["graphs_traced"] == 1, cold
    assert warm["warm_start"] is True and warm["graphs_traced"] == 0, warm
    assert warm["error"] <= 1e-5 and cold["error"] <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["module", "function"])
def test_a_model_defined_in_the_script_starts_warm(tmp_path, kind):
    script = _script(tmp_path)
    command = [sys.executable, str(script), kind, "eager"]
    cold = _run([*command, "5,9"], tmp_path, tmp_path / "cache")
    warm = _run([*command, "5,9,13,2"], tmp_path, tmp_path / "cache")  # 13 and 2: sizes not seen
    _assert_cold_then_warm(cold, warm)


@pytest.mark.slow
@pytest.mark.inductor
def test_a_model_defined_in_the_script_starts_warm_with_inductor(tmp_path):
    script = _script(tmp_path)
    command = [sys.executable, str(script), "module", "inductor"]
    cold = _run([*command, "5"], tmp_path, tmp_path / "cache")
    warm = _run([*command, "5,11"], tmp_path, tmp_path / "cache")
    _assert_cold_then_warm(cold, warm)


@pytest.mark.slow
def test_a_script_run_as_a_module_starts_warm(tmp_path):
    """``python -m pkg.serve``: ``__main__`` is named by its spec, its globals are still ``__main__``'s."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "serve.py").write_text(SCRIPT)
    command = [sys.executable, "-m", "pkg.serve", "module", "eager"]
    cold = _run([*command, "5"], tmp_path, tmp_path / "cache")
    warm = _run([*command, "5,12"], tmp_path, tmp_path / "cache")
    _assert_cold_then_warm(cold, warm)


@pytest.mark.slow
def test_the_warm_process_reads_the_scripts_globals_as_they_are_now(tmp_path):
    """A tensor the graph reads is the warm process's own; a value the trace baked in (a dict item,
    a nested function's closure cell) that changed makes the warm start trace again."""
    script = _script(tmp_path)
    cache = tmp_path / "cache"
    command = [sys.executable, str(script), "module", "eager", "5,9"]
    _run(command, tmp_path, cache)
    scaled = _run(command, tmp_path, cache, SCALE="-1.5")
    assert scaled["warm_start"] is True and scaled["error"] == 0.0, scaled
    reconfigured = _run(command, tmp_path, cache, CFG_K="3.0")
    assert reconfigured["warm_start"] is False and reconfigured["graphs_traced"] == 1, reconfigured
    assert "__main__.CFG['k']" in reconfigured["refused"] and reconfigured["error"] == 0.0
    sloped = _run(command, tmp_path, cache, CFG_K="3.0", SLOPE="0.3")
    assert sloped["warm_start"] is False and sloped["graphs_traced"] == 1, sloped
    assert "__main__.LEAKY.__closure__[0]" in sloped["refused"] and sloped["error"] == 0.0


@pytest.mark.slow
def test_two_scripts_of_one_name_in_two_directories_are_two_models(tmp_path):
    """a/serve.py and b/serve.py, one cache: b's helper's code differs (nothing the call check
    reads), so only the fingerprint tells them apart: b never runs a's artifact."""
    cache = tmp_path / "cache"
    reports = []
    for name, bias in (("a", "0.25"), ("b", "0.75")):
        folder = tmp_path / name
        folder.mkdir()
        source = SCRIPT.replace("def helper(x, bias=0.25):", "def helper(x, bias=0.25):\n    bias = " + bias)
        (folder / "serve.py").write_text(source)
        reports.append(_run([sys.executable, "serve.py", "module", "eager", "5,9"], folder, cache))
    for report in reports:  # each traced for itself, with its own numbers
        assert report["warm_start"] is False and report["error"] == 0.0, report


# -- in this process: a name of __main__ the warm process does not define ------------------------
MAIN_SOURCE = """
import torch
SCALE = torch.full((4,), 0.5)
SHIFT = torch.full((4,), 0.25)

def scaled(x):
    return (x * SCALE).relu() + SHIFT  # two reads: Dynamo keeps the alias in a temporary
"""


def _fake_main(path: Path) -> types.ModuleType:
    """A module named ``__main__`` built from a file, as a script's is."""
    path.write_text(MAIN_SOURCE)
    module = types.ModuleType("__main__")
    module.__file__ = str(path)
    exec(compile(MAIN_SOURCE, str(path), "exec"), module.__dict__)
    return module


def test_a_name_of_main_the_warm_process_lacks_refuses_the_artifact(tmp_path, monkeypatch):
    """The saved bytecode reads ``__main__.SHIFT``: a ``__main__`` without it refuses the artifact
    (the caller traces instead, saying why) before any kernel loads, instead of failing a call."""
    script = _fake_main(tmp_path / "script.py")
    monkeypatch.setitem(sys.modules, "__main__", script)
    compiled = tessera.compile(script.scaled, backend="eager")
    x = torch.randn(5, 4)
    torch.testing.assert_close(compiled(x), script.scaled(x))
    entry = CacheEntry.open_existing(compiled.cache_dir)
    assert isinstance(entry, CacheEntry)
    data = entry.read_model()
    assert isinstance(data, bytes)
    saved = artifact.loads(data)
    assert isinstance(saved, artifact.ModelArtifact)
    (variant,) = saved.variants
    assert ("__import___main__", "__main__") in variant.code.modules
    assert dict(variant.code.reads)["__import___main__"] == ("SCALE", "SHIFT")
    other = types.ModuleType("__main__")  # the warm process runs another script, without SHIFT
    other.SCALE = script.SCALE
    monkeypatch.setitem(sys.modules, "__main__", other)
    refused = artifact.check_binds(saved.variants[0])
    assert isinstance(refused, Refused)
    assert re.search(r"reads __main__\.SHIFT, which is not defined here", refused.reason)
    monkeypatch.setitem(sys.modules, "__main__", script)
    tessera.counters.reset()
    warm = tessera.compile(script.scaled, backend="eager")
    torch.testing.assert_close(warm(x), script.scaled(x))
    assert warm.warm_start is True and tessera.counters.snapshot()["graphs_traced"] == 0


def test_a_namespace_dict_in_the_bytecode_is_not_saved_as_a_copy():
    """Dynamo reads some namespaces by identity (a scope without ``__name__``): a pickled copy
    would be stale in the next process, so no artifact is written for such code."""
    namespace = {"__builtins__": __builtins__, "__name__": "x"}
    code = compile("def f():\n    return ___unnamed_scope_1_c0['y']\n", "<test>", "exec")
    exec(code, namespace)
    namespace["___unnamed_scope_1_c0"] = {"y": 1}
    refused = portable.capture_code(namespace["f"].__code__, namespace["f"])
    assert isinstance(refused, Refused) and "namespace" in refused.reason
