"""The suite's own tools: the C++ compiler its Inductor tests build kernels with."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

WRAPPER = Path(__file__).parent / "tools" / "cached-g++"
SOURCE = 'extern "C" int twice(int x) { return 2 * x; }\n'


@pytest.mark.skipif(shutil.which("ccache") is None, reason="ccache is not installed (make test installs it)")
def test_the_cached_compiler_builds_a_loadable_library_and_a_second_directory_hits_its_cache(tmp_path):
    env = {**os.environ, "CCACHE_DIR": str(tmp_path / "ccache"), "CCACHE_NOHASHDIR": "1"}
    env.pop("TESSERA_TEST_REAL_CXX", None)  # g++ from the PATH
    libraries = []
    for name in ("one", "two"):  # as Inductor calls it: one call, source to shared library
        directory = tmp_path / name
        directory.mkdir()
        (directory / "k.cpp").write_text(SOURCE)
        library = directory / "k.so"
        command = [str(WRAPPER), str(directory / "k.cpp"), "-O2", "-shared", "-fPIC", "-o", str(library)]
        subprocess.run(command, env=env, check=True, capture_output=True, timeout=120)
        assert library.is_file() and not list(directory.glob("*.o"))  # the object is not left behind
        libraries.append(ctypes.CDLL(str(library)))
    assert [lib.twice(21) for lib in libraries] == [42, 42]
    stats = subprocess.run(
        ["ccache", "--print-stats"], env=env, check=True, capture_output=True, text=True, timeout=60
    ).stdout
    counts = dict(line.split("\t")[:2] for line in stats.splitlines() if "\t" in line)
    assert int(counts["direct_cache_hit"]) + int(counts.get("preprocessed_cache_hit", 0)) == 1, stats
