"""Seeing what was compiled and finding what went wrong: progress, report, dumps, bisection."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tessera
from tessera.debug import bisect
from tessera.models import toy_llama

ROOT = Path(__file__).resolve().parents[1]

COMPILE_SCRIPT = """
import torch, tessera
from tessera.models import toy_llama
model = toy_llama.build(num_layers=2)
compiled = tessera.compile(model, backend="{backend}", compile_sizes=[4], prefix="toy")
with torch.no_grad():
    for n in (5, 4, 9):
        compiled(*toy_llama.example_inputs(n))
"""


def _script(tmp_path: Path, backend: str = "eager") -> Path:
    path = tmp_path / "compile_toy.py"
    path.write_text(COMPILE_SCRIPT.format(backend=backend))
    return path


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, TESSERA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


# -- progress -------------------------------------------------------------------------------------
def _run_in_terminal(script: Path, env: dict[str, str]) -> str:
    """Run ``script`` with stderr on a pseudo-terminal; return what the terminal showed."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=follower, env=env, cwd=ROOT
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_a_cold_compile_on_a_terminal_shows_a_progress_bar(tmp_path):
    shown = _run_in_terminal(_script(tmp_path), _env(tmp_path))
    assert "tessera" in shown and "toy" in shown
    assert "6/6" in shown  # three compiled pieces x (general + size 4), counted by the bar
    assert "━" in shown  # rich's bar


def test_piped_it_logs_one_line_per_piece_and_progress_0_shows_nothing(tmp_path):
    logging_script = tmp_path / "logged.py"
    logging_script.write_text(
        "import logging\nlogging.basicConfig(level=logging.INFO)\n" + COMPILE_SCRIPT.format(backend="eager")
    )
    piped = subprocess.run(
        [sys.executable, str(logging_script)],
        env=_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line for line in piped.stderr.splitlines() if "tessera.debug.progress" in line]
    assert len(lines) == 3 and all("done" in line for line in lines), piped.stderr[-2000:]
    assert "━" not in piped.stderr
    (tmp_path / "q").mkdir()
    quiet = _run_in_terminal(_script(tmp_path / "q"), _env(tmp_path / "q", TESSERA_PROGRESS="0"))
    assert "━" not in quiet and "6/6" not in quiet


# -- report ---------------------------------------------------------------------------------------
def test_report_of_a_cold_and_a_warm_entry_shows_every_piece_and_size(tmp_path):
    script = _script(tmp_path)
    for _ in range(2):  # cold, then warm
        subprocess.run(
            [sys.executable, str(script)], env=_env(tmp_path), cwd=ROOT, check=True, capture_output=True
        )
    (entry,) = (tmp_path / "cache").glob("*/rank_*/toy")
    assert (entry / "report-cold.json").exists() and (entry / "report-warm.json").exists()
    shown = subprocess.run(  # noqa: PLW1510 (the return code is asserted)
        [sys.executable, "-m", "tessera", "report", str(entry)],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    assert "warm start" in shown.stdout and "cold start took" in shown.stdout
    for piece in ("submod_0", "submod_2", "submod_4"):
        assert piece in shown.stdout
    assert "size 4" in shown.stdout and "general" in shown.stdout and "loaded" in shown.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "tessera", "report", str(entry), "--json"],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(as_json.stdout)
    assert data["kind"] == "warm" and len(data["artifacts"]) == 6


def test_report_json_of_a_script_matches_compiled_report(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "tessera", "report", str(_script(tmp_path)), "--json"],
        env=_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    (printed,) = json.loads(out.stdout)
    model = toy_llama.build(num_layers=2)
    compiled = tessera.compile(
        model, backend="eager", compile_sizes=[4], prefix="toy", cache_dir=str(tmp_path / "c2")
    )
    with torch.no_grad():
        for n in (5, 4, 9):
            compiled(*toy_llama.example_inputs(n))
    ours = compiled.report.as_dict()
    for key in ("model", "kind", "mode", "backend", "pieces", "compiled_pieces"):
        assert printed[key] == ours[key]
    strip = lambda report: [(a["piece"], a["size"], a["source"], a["served"]) for a in report["artifacts"]]  # noqa: E731
    assert strip(printed) == strip(ours)


# -- dumps and the structured trace ---------------------------------------------------------------
def _expect_dumps(folder: Path, pieces: int) -> None:
    for name in ("traced_graph.py", "computation_graph.py", "transformed_code.py", "cache_key_factors.json"):
        assert (folder / name).stat().st_size > 0, name
    assert "def forward" in (folder / "traced_graph.py").read_text()
    assert len(list((folder / "pieces").glob("*.py"))) == pieces


@pytest.mark.inductor
def test_debug_dumps_for_the_toy_llama_and_a_hugging_face_model(tmp_path, monkeypatch):
    model = toy_llama.build(num_layers=2)
    compiled = tessera.compile(model, backend="inductor", prefix="toy", debug_dump_dir=str(tmp_path / "dump"))
    with torch.no_grad():
        compiled(*toy_llama.example_inputs(5))
    _expect_dumps(tmp_path / "dump" / "toy", pieces=3)
    assert (
        "def call(" in next((tmp_path / "dump" / "toy" / "pieces").glob("*.py")).read_text()
    )  # Inductor's code
    from tests.test_hf import build

    hf_model, _ = build("llama")
    # The dump directory from the environment, read when the config is made.
    monkeypatch.setenv("TESSERA_DEBUG_DUMP", str(tmp_path / "env-dump"))
    hf_compiled = tessera.compile(hf_model, backend="inductor", prefix="llama", dynamic_dims={"input_ids": 1})
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        expected = hf_model(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(hf_compiled(input_ids=ids, use_cache=False).logits, expected)
    _expect_dumps(tmp_path / "env-dump" / "llama", pieces=3)


def test_transformed_code_is_decompiled_or_disassembled(monkeypatch):
    from tessera.debug import dumps

    pytest.importorskip("depyf", reason="the debug extra (make test installs it)")
    code = compile("x = 1 + 2", "<test>", "exec")
    text = dumps.decompile(code)
    assert "decompiled by depyf" in text and "x = 3" in text.replace("1 + 2", "3"), text
    monkeypatch.setitem(sys.modules, "depyf", None)  # as if the debug extra were not installed
    text = dumps.decompile(code)
    assert "disassembly" in text and "depyf is not installed" in text


def test_tlparse_lists_tesseras_stages(tmp_path):
    tlparse = shutil.which("tlparse") or str(Path(sys.executable).parent / "tlparse")
    assert Path(tlparse).exists(), "tlparse is a dev dependency (make test installs it)"
    trace_dir = tmp_path / "trace"
    subprocess.run(
        [sys.executable, str(_script(tmp_path))],
        env=_env(tmp_path, TORCH_TRACE=str(trace_dir)),
        cwd=ROOT,
        check=True,
    )
    (log,) = trace_dir.glob("*.log")
    out = tmp_path / "parsed"
    subprocess.run([tlparse, str(log), "-o", str(out), "--no-browser"], check=True, capture_output=True)
    listing = "\n".join(p.name for p in out.rglob("*"))
    assert "tessera_split_graph" in listing and "tessera_piece" in listing, listing[:2000]
    assert "tessera_compile_report" in listing


# -- bisection ------------------------------------------------------------------------------------
def test_bisect_names_the_one_piece_a_wrong_compiler_perturbed():
    model = toy_llama.build(num_layers=2)
    compiled = tessera.compile(model, backend="tests.custom_compiler:PerturbingCompiler", disable_cache=True)
    args = toy_llama.example_inputs(6)
    result = bisect(model, compiled, *args)
    assert result.first_bad is not None and result.first_bad.piece == "submod_2"
    assert result.first_bad.max_abs > 1e-2
    assert any("toy_llama.py" in line for line in result.first_bad.source_lines)
    assert all(e.within for e in result.errors if e.piece != "submod_2")


def test_bisect_of_a_correct_compile_is_within_tolerance_cold_and_warm(tmp_path):
    model = toy_llama.build(num_layers=2)
    args = toy_llama.example_inputs(6)
    cold = tessera.compile(model, backend="eager", cache_dir=str(tmp_path / "c"))
    assert bisect(model, cold, *args).first_bad is None
    warm = tessera.compile(model, backend="eager", cache_dir=str(tmp_path / "c"))
    result = bisect(model, warm, *args)  # warm: no trace here, the split comes from a reference trace
    assert warm.warm_start is True and result.first_bad is None and len(result.errors) >= 3


def test_bisect_command_runs_a_script(tmp_path):
    script = tmp_path / "perturbed.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, tessera
            from tessera.models import toy_llama
            model = toy_llama.build(num_layers=2)
            wrong = "tests.custom_compiler:PerturbingCompiler"
            compiled = tessera.compile(model, backend=wrong, prefix="bad")
            with torch.no_grad():
                compiled(*toy_llama.example_inputs(6))
            """
        )
    )
    out = subprocess.run(  # noqa: PLW1510 (the return code is asserted)
        [sys.executable, "-m", "tessera", "bisect", str(script)],
        env=_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "first piece over tolerance: submod_2" in out.stdout
