"""Keys: one record per kind of key, built by one hasher, with its factors printable; the same key
for an entry whether it was created (cold) or opened for a warm start."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import tessera
from tessera.cache.entry import FACTORS, CacheEntry
from tessera.cache.explain import explain
from tessera.cache.key import KeyRecord, config_record, fingerprint_record, machine_key
from tessera.compilation.compilers import EagerCompiler, InductorCompiler
from tessera.config import CompileConfig
from tessera.models import toy_llama


def _old_recipe(factors) -> str:
    """How config and compiler hashes were made before the one hasher (their values must stay)."""
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def test_one_hasher_keeps_every_existing_key_value():
    config = CompileConfig(backend="eager", compile_sizes=(4, 8), inductor_config={"max_autotune": True})
    record = config_record(config)
    assert record.kind == "config" and record.digest == _old_recipe(config.hash_factors())
    inductor = InductorCompiler()
    record = inductor.key_record()
    assert record.kind == "compiler" and inductor.compute_hash() == record.digest == _old_recipe(
        record.factors
    )
    assert len(machine_key()) == 16
    assert EagerCompiler().compute_hash() == hashlib.sha256(b"tessera-eager-v1").hexdigest()


def test_a_key_record_prints_its_factors():
    record = KeyRecord.of("config", {"mode": "piecewise", "compile_sizes": [4, 8]})
    lines = record.debug_lines()
    assert lines[0] == f"config key {record.digest}"
    assert "  compile_sizes: [4, 8]" in lines and '  mode: "piecewise"' in lines
    with pytest.raises(AssertionError, match="unknown key kind"):
        KeyRecord.of("guess", {})


def _cold_entry():
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend="eager")
    with torch.no_grad():
        compiled(*toy_llama.example_inputs(5))
    entry = compiled.cache_dir
    assert entry is not None
    return entry


def test_an_entry_has_one_key_whether_created_or_opened_warm():
    entry = _cold_entry()
    factors = json.loads((entry / FACTORS).read_text())
    created = CacheEntry.create(
        entry.parents[2], entry.name, factors, (entry / "computation_graph.py").read_text(), []
    )
    opened = CacheEntry.open_existing(entry)
    assert created is not None and isinstance(opened, CacheEntry)
    assert len(created.key) == 64 and opened.key == created.key
    assert opened.key_record == created.key_record == KeyRecord.of("entry", factors)
    assert entry.parents[1].name == created.key[:10]


def test_fingerprint_is_a_key_record_of_its_factors():
    model = toy_llama.build(num_layers=1)
    record = fingerprint_record(
        type(model).forward,
        model,
        None,
        CompileConfig(),
        "h",
        "model",
        "r0",
    )
    assert record.kind == "fingerprint" and len(record.digest) == 64
    assert any(line.startswith("  config:") for line in record.debug_lines())


def test_explain_reads_the_entry_key_and_says_when_factors_do_not_match_it():
    entry = _cold_entry()
    lines = explain(entry.parents[2], entry)
    assert any(line.startswith("entry key ") for line in lines), lines
    factors = json.loads((entry / FACTORS).read_text())
    factors["config"]["max_size"] = 1234  # edited by hand: no longer what the entry was keyed by
    (entry / FACTORS).write_text(json.dumps(factors))
    lines = explain(entry.parents[2], entry)
    assert any("do not hash to this entry's key" in line for line in lines), lines


def test_pieces_alike_but_for_which_size_is_which_dim_do_not_share_a_shape_artifact():
    """A shape's values follow the size symbols' names; a piece's content renames them in the order
    they appear. A piece given x [a, b] and one given y [b, a] would otherwise share content, and
    shape (2, 3) would hand one the other's artifact."""
    from tessera.cache.key import piece_content

    seen = {}

    def capture(gm, example_inputs):
        seen["gm"] = gm
        return gm.forward

    x = torch.randn(2, 3)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1)
    torch.compile(lambda x: x.t().contiguous() + 1, backend=capture, fullgraph=True)(x)
    values = [n.meta["example_value"] for n in seen["gm"].graph.nodes if "example_value" in n.meta]
    fake_x = next(v for v in values if isinstance(v, torch.Tensor) and v.dim() == 2)
    swapped = (str(fake_x.shape[1]), str(fake_x.shape[0]))
    fake_y = next(  # x.t().contiguous(): [b, a], strides (a, 1)
        v
        for v in values
        if isinstance(v, torch.Tensor)
        and tuple(map(str, v.shape)) == swapped
        and tuple(map(str, v.stride())) == (swapped[1], "1")
    )
    relu = torch.fx.symbolic_trace(lambda t: t.relu())
    as_x, as_y = piece_content(relu, [fake_x]), piece_content(relu, [fake_y])
    assert as_x != as_y
    assert piece_content(relu, [fake_x]) == as_x  # and the same piece keeps its content
