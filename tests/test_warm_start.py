"""The warm path: cheap imports, the index schema, piece files, fallbacks that trace once."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import tessera
from tessera.cache import index
from tessera.cache.entry import INDEX
from tessera.models import toy_llama
from tests.child import ROOT, child_env, run_toy


def test_import_tessera_imports_neither_dynamo_nor_inductor():
    code = (
        "import json, sys, tessera, tessera.hf, tessera.models.toy_llama; "
        "print(json.dumps([m for m in ('torch._dynamo', 'torch._inductor', 'sympy') if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("collector", ["enabled", "disabled"])
def test_the_first_use_imports_with_the_collector_paused_and_leaves_it_as_it_was(collector):
    """The machinery ``tessera.compile`` imports at its first use runs no full collection of
    torch's heap (nothing of it is garbage), and the collector is left as the user had it."""
    code = (
        "import gc, importlib, json, tessera\n"
        f"{'gc.disable()' if collector == 'disabled' else ''}\n"
        "seen = []\n"
        "real = importlib.import_module\n"
        "importlib.import_module = lambda name, *a: (seen.append(gc.isenabled()), real(name, *a))[1]\n"
        "tessera.compile\n"
        "print(json.dumps([seen, gc.isenabled(), 'tessera.api' in __import__('sys').modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120
    )
    seen, after, imported = json.loads(out.stdout)
    assert seen and not any(seen) and imported  # every import made meanwhile, too
    assert after is (collector == "enabled")


def test_index_round_trips_and_rejects_wrong_types():
    parsed = index.Index(created=1.0)
    parsed.entries[("general", 0, "inductor")] = index.ArtifactRecord("artifacts/a.bin", "ab" * 32, 10, "c1")
    parsed.entries[((1, 8), 2, "inductor")] = index.ArtifactRecord("", "", 0, "c2")
    parsed.files["cache_key_factors.json"] = "cd" * 32
    parsed.model = index.FileRecord("model_artifact.pkl", "ef" * 32, 5)
    again = index.parse(parsed.format())
    assert again == parsed
    bad = [
        "{'version': 2, 'created': 1.0, 'entries': {('general', '0', 'x'): {}}}",
        "{'version': 2, 'created': 1.0, 'entries': {(True, 0, 'x'): {'file': '', 'sha256': '', 'size': 0}}}",
        "{'version': 2, 'created': 1.0, 'entries': {}, 'files': {'../x': 'ab'}}",
        "{'version': 2, 'created': 1.0, 'entries': {('general', 0, 'x'): "
        "{'file': '/etc/passwd', 'sha256': '', 'size': 0}}}",
        "{'version': 1, 'created': 1.0, 'entries': {}}",
        "__import__('os').system('true')",
    ]
    for text in bad:
        with pytest.raises((ValueError, SyntaxError)):
            index.parse(text)


@pytest.mark.inductor
def test_identical_layers_compile_and_store_once_on_an_empty_inductor_cache(tmp_path):
    """Eight layers, three distinct pieces (first, middle x7, last): three compiles, three files."""
    args = ["--layers", "8", "--compile-sizes", "", "--sizes", "5,12", "--backend", "inductor"]
    report = run_toy(
        tmp_path / "cache", tmp_path / "out.pt", *args, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")
    )
    counts = report["counters"]
    assert counts["compiled_pieces"] == 9 and counts["inductor_compiles"] == 3
    assert counts["backend_compilations"] == 9 and counts["cache_hits"] == 6  # twins share
    entry = Path(report["cache_dir"])
    assert len(list((entry / "artifacts").glob("*.bin"))) == 3
    # Inductor's ISA probe ran once here; its result is kept for the next process on this machine.
    (record,) = (tmp_path / "cache" / "machine").glob("*.json")
    assert json.loads(record.read_text())["vec_isa"]
    records = index.parse((entry / INDEX).read_text()).entries
    assert len(records) == 9 and len({r.file for r in records.values()}) == 3


def _compile_and_check(model, sizes=(3, 9), **overrides):
    compiled = tessera.compile(model, backend="eager", **overrides)
    with torch.no_grad():
        for n in sizes:
            ids, pos = toy_llama.example_inputs(n)
            torch.testing.assert_close(compiled(ids, pos), model(ids, pos))
    return compiled


def test_warm_start_with_the_eager_compiler_skips_dynamo():
    model = toy_llama.build(num_layers=2)
    cold = _compile_and_check(model)
    tessera.counters.reset()
    warm = _compile_and_check(model)
    assert warm.warm_start is True and cold.warm_start is False
    counts = tessera.counters.snapshot()
    assert counts["graphs_traced"] == 0 and counts["eager_compiles"] == 0
    assert [p.name for p in warm.pieces] == [p.name for p in cold.pieces]
    assert [p.is_splitting for p in warm.pieces] == [p.is_splitting for p in cold.pieces]


def test_identical_attention_layers_are_one_source_in_the_whole_model_artifact():
    from tessera.cache.entry import CacheEntry
    from tessera.trace import model_artifact as artifact

    model = toy_llama.build(num_layers=4)
    cold = _compile_and_check(model)
    entry = CacheEntry.open_existing(cold.cache_dir)
    assert isinstance(entry, CacheEntry)
    data = entry.read_model()
    assert isinstance(data, bytes)
    saved = artifact.loads(data)
    assert isinstance(saved, artifact.ModelArtifact)
    assert len(saved.modules) == 4  # one splitting piece per layer, built from one source
    assert len({module.source for _, module in saved.modules}) == 1
    assert all(module.code is not None for _, module in saved.modules)
    tessera.counters.reset()
    warm = _compile_and_check(model)  # and the shared source runs every layer right
    assert warm.warm_start is True and tessera.counters.snapshot()["graphs_traced"] == 0


WARM_THEN_TRACE = """
import torch, tessera
from tessera.models import toy_llama
model = toy_llama.build(num_layers=1)
first = tessera.compile(model, backend="eager")
other = toy_llama.build(num_layers=2)
second = tessera.compile(other, backend="eager", disable_cache=True)  # always traced
with torch.no_grad():
    for compiled, eager in ((first, model), (second, other)):
        args = toy_llama.example_inputs(9)
        torch.testing.assert_close(compiled(*args), eager(*args))
print("warm" if first.warm_start else "cold")
"""


def test_a_trace_after_a_warm_start_in_the_same_process(tmp_path):
    # A warm start binds stand-ins for Dynamo's modules; a later trace must see the real ones.
    script = tmp_path / "warm_then_trace.py"
    script.write_text(WARM_THEN_TRACE)
    env = child_env(tmp_path / "cache")
    runs = [
        subprocess.run(
            [sys.executable, str(script)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-3000:]
    assert [r.stdout.split()[0] for r in runs] == ["cold", "warm"]


MODEL_SOURCE = """
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4), requires_grad=False)

    def forward(self, x):
        return (x @ self.w).relu() + {bias}
"""


def test_a_changed_source_file_falls_back_to_one_trace_and_says_why(tmp_path, monkeypatch, caplog):
    source = tmp_path / "edited_model.py"
    source.write_text(textwrap.dedent(MODEL_SOURCE.format(bias=1)))
    monkeypatch.syspath_prepend(str(tmp_path))
    import edited_model

    model = edited_model.Model()
    x = torch.randn(5, 4)
    tessera.compile(model, backend="eager")(x)
    # The file changes on disk; the model in this process is the old code, so its fingerprint
    # still leads to the artifact, which must notice and step aside.
    source.write_text(textwrap.dedent(MODEL_SOURCE.format(bias=2)))
    tessera.counters.reset()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tessera.trace.warm"):
        compiled = tessera.compile(model, backend="eager")
        torch.testing.assert_close(compiled(x), model(x))
    assert tessera.counters.snapshot()["graphs_traced"] == 1
    reasons = [r.getMessage() for r in caplog.records if "a saved trace does not load" in r.getMessage()]
    assert len(reasons) == 1 and "edited_model.py changed" in reasons[0], reasons
    assert compiled.warm_start is False and "edited_model.py" in (compiled.warm_start_refused or "")


def test_a_warm_start_that_fails_halfway_leaves_a_clean_trace(caplog):
    """An index missing one piece's artifact: the rebuild stops, the trace starts from scratch."""
    model = toy_llama.build(num_layers=2)
    cold = _compile_and_check(model)
    entry = cold.cache_dir
    parsed = index.parse((entry / INDEX).read_text())
    last = max(parsed.entries, key=lambda key: key[1])
    del parsed.entries[last]
    (entry / INDEX).write_text(parsed.format())
    tessera.counters.reset()
    with caplog.at_level(logging.INFO, logger="tessera.api"):
        again = _compile_and_check(model)
    counts = tessera.counters.snapshot()
    assert again.warm_start is False and counts["graphs_traced"] == 1
    assert counts["pieces"] == len(cold.pieces)  # counted once: the failed rebuild counted nothing
    assert "its artifact is missing" in (again.warm_start_refused or "")
    assert len(again.pieces) == len(cold.pieces)


@pytest.mark.inductor
def test_piece_file_without_direct_code_loads_through_inductor(tmp_path):
    """GPU pieces (and any piece AOTAutograd wraps) have no direct code: Inductor's loader serves."""
    from tessera.compilation import piece_file
    from tessera.compilation.compilers import InductorCompiler

    def fn(x, w):
        return ((x @ w).relu() * 3,)

    traced = {}

    def capture(gm, example_inputs):
        traced.update(gm=gm, inputs=example_inputs)
        return gm.forward

    x, w = torch.randn(6, 8), torch.randn(8, 8)
    torch.compile(fn, backend=capture, fullgraph=True)(x, w)  # a Dynamo graph, as tessera's pieces
    compiler = InductorCompiler()
    compiler.initialize_cache(tmp_path)
    compiled, handle = compiler.compile(
        traced["gm"], traced["inputs"], tessera.CompileConfig(), 6, "piece.bin"
    )
    (expected,) = fn(x, w)
    torch.testing.assert_close(compiled(x, w)[0], expected)
    piece = piece_file.PieceFile.from_bytes((tmp_path / handle).read_bytes())
    # CPU: both ways are stored, and the wrapper's code compiled with it.
    assert piece.direct is not None and piece.direct.code and piece.standard
    stripped = piece_file.PieceFile(piece.standard, None, piece.returns_tuple, "as if on a GPU")
    (tmp_path / "stripped.bin").write_bytes(stripped.to_bytes())
    loaded = InductorCompiler()
    loaded.initialize_cache(tmp_path)
    torch.testing.assert_close(loaded.load("stripped.bin", None, (), 0, 6)(x, w)[0], expected)
    with pytest.raises(ValueError, match="not a tessera piece file"):
        piece_file.PieceFile.from_bytes(b"garbage")


def test_recorded_isa_probe_is_trusted_only_when_the_cpu_flags_agree(tmp_path):
    from tessera import _compat
    from tessera.compilation.compilers import InductorCompiler

    candidates = _compat.vec_isa_candidates()
    compiler = InductorCompiler()
    assert not compiler._probe_recorded()  # no cache root: nothing recorded, always probe
    compiler.use_machine_record(tmp_path)
    assert compiler.machine_record is not None and not compiler._probe_recorded()
    compiler.machine_record.parent.mkdir(parents=True)
    compiler.machine_record.write_text(json.dumps({"vec_isa": "an ISA this CPU does not claim"}))
    assert not compiler._probe_recorded()
    if candidates:  # x86: the widest ISA the flags claim is what a successful probe picks
        compiler.machine_record.write_text(json.dumps({"vec_isa": candidates[0]}))
        assert compiler._probe_recorded()
    compiler.machine_record.write_text("{damaged")
    assert not compiler._probe_recorded()


def _direct(source: str, code: bytes | None = None, bytecode: str | None = None) -> Any:
    import marshal

    from tessera.compilation import piece_file

    compiled = marshal.dumps(compile(source, "<tessera piece>", "exec")) if code is None else code
    return piece_file.DirectCode(
        wrapper=source,
        kernels=(),
        extern=(),
        num_inputs=1,
        num_outputs=1,
        code=compiled,
        bytecode=piece_file.BYTECODE if bytecode is None else bytecode,
    )


def test_a_piece_loads_the_wrapper_code_compiled_with_it_and_compiles_only_what_it_cannot_use(monkeypatch):
    """Compiling a piece's wrapper holds the GIL for milliseconds: the code compiled where the piece
    compiled is stored with it and loaded instead, where this interpreter's bytecode is its own."""
    import traceback

    from tessera.compilation import piece_file

    source = (
        "def call(args):\n"
        "    (x,) = args\n"
        "    if x.sum() < 0:\n"
        "        raise ValueError('negative')\n"
        "    return (x * 2,)\n"
    )
    stored = piece_file.PieceFile(b"standard", _direct(source), True)
    direct = piece_file.PieceFile.from_bytes(stored.to_bytes()).direct
    assert direct is not None and direct.code and direct.bytecode == piece_file.BYTECODE
    compiled: list[str] = []

    def counting(text: str, filename: str, mode: str) -> Any:
        compiled.append(filename)
        return compile(text, filename, mode)

    monkeypatch.setattr(piece_file, "compile", counting, raising=False)
    x = torch.arange(3.0)
    run = piece_file.load_direct(direct, "submod_1")
    torch.testing.assert_close(run(x)[0], x * 2)
    assert compiled == []
    # Its traceback names the piece, with the wrapper's lines, as one compiled here would.
    with pytest.raises(ValueError) as raised:
        run(-x - 1)
    frame = traceback.extract_tb(raised.value.__traceback__)[-1]
    assert frame.filename == "<tessera piece submod_1>" and "raise ValueError" in (frame.line or "")
    # Another interpreter's bytecode, bytes that do not unmarshal, a file written before the code
    # was kept: the wrapper is compiled, and runs the same.
    for other in (
        _direct(source, bytecode="0d0d0d0a"),
        _direct(source, code=b"\x00not marshal"),
        _direct(source, code=b""),
    ):
        torch.testing.assert_close(piece_file.load_direct(other, "submod_1")(x)[0], x * 2)
    # A file written before the code was kept: its header has no "code".
    data = stored.to_bytes()
    start = len(piece_file.MAGIC) + 8
    (length,) = struct.unpack("<Q", data[len(piece_file.MAGIC) : start])
    header = json.loads(data[start : start + length])
    del header["direct"]["code"], header["direct"]["bytecode"]
    encoded = json.dumps(header).encode()
    older = piece_file.MAGIC + struct.pack("<Q", len(encoded)) + encoded + data[start + length :]
    direct = piece_file.PieceFile.from_bytes(older).direct
    assert direct is not None and direct.code == b""
    torch.testing.assert_close(piece_file.load_direct(direct, "submod_1")(x)[0], x * 2)
    assert compiled == ["<tessera piece submod_1>"] * 4
