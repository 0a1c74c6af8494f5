"""Compiler adaptors: what the Inductor compiler notes about its callables is held by the callable's
identity, for no longer than the callable lives."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch

from tessera.compilation import piece_file
from tessera.compilation.compilers import InductorCompiler

# A piece's direct code without kernels: Inductor's wrapper shape, loadable without Inductor.
WRAPPER = "def call(args):\n    (x,) = args\n    return (x + 1,)\n"


def _piece_file(directory: Path, name: str, partitions: int) -> str:
    direct = piece_file.DirectCode(wrapper=WRAPPER, kernels=(), extern=(), num_inputs=1, num_outputs=1)
    piece = piece_file.PieceFile(standard=b"", direct=direct, returns_tuple=True, partitions=partitions)
    (directory / name).write_bytes(piece.to_bytes())
    return name


def test_notes_go_with_their_callable_and_never_reach_one_at_a_reused_id(tmp_path):
    compiler = InductorCompiler()
    compiler.initialize_cache(tmp_path)
    handle = _piece_file(tmp_path, "a.bin", partitions=2)
    fn = compiler.load(handle, None, (), 0, None)
    assert compiler.load(handle, None, (), 1, None) is fn  # identical pieces load once while alive
    torch.testing.assert_close(fn(torch.zeros(2)), (torch.ones(2),))
    assert compiler.output_code(fn) == WRAPPER and compiler.partitions_of(fn) == 2

    released, freed = weakref.ref(fn), id(fn)
    del fn
    gc.collect()
    assert released() is None  # the compiler keeps neither the piece nor, with it, its source alive

    # CPython hands a freed object's memory to the next object of its size: new functions soon
    # sit at the freed id. None of them may find the notes of the piece that lived there.
    candidates = [lambda *args: args for _ in range(256)]
    assert all(compiler.output_code(c) is None for c in candidates)
    assert all(compiler.partitions_of(c) is None for c in candidates)
    reused = [c for c in candidates if id(c) == freed]
    if reused:  # the case the test is about; the assertions above cover it when it happens
        assert compiler.output_code(reused[0]) is None


def test_a_piece_loaded_again_after_release_gets_fresh_notes(tmp_path):
    compiler = InductorCompiler()
    compiler.initialize_cache(tmp_path)
    handle = _piece_file(tmp_path, "b.bin", partitions=3)
    first = compiler.load(handle, None, (), 0, None)
    del first
    gc.collect()
    again = compiler.load(handle, None, (), 0, None)
    assert compiler.output_code(again) == WRAPPER and compiler.partitions_of(again) == 3
