"""The examples run as users run them, in a fresh process, and check themselves against eager.

The diffusers example needs the [diffusers] extra, which ``make install`` installs."""

from __future__ import annotations

import pytest

from tests.child import run_module

pytestmark = pytest.mark.slow  # a pipeline in a fresh process: not in make test-fast


def test_the_diffusers_pipeline_example_matches_eager_at_batch_1_and_2(tmp_path):
    # The eager compiler: the pipeline's tracing, splitting, dispatch and cache are what this tests
    # (with Inductor it takes a minute of CI; `python examples/diffusers_pipeline.py` runs it).
    proc = run_module("examples.diffusers_pipeline", "--backend", "eager", cache=tmp_path / "cache")
    lines = proc.stdout.splitlines()
    assert sum("equal to eager: True" in line for line in lines) == 3, proc.stdout
    assert any(line.startswith("unet: dynamic [('sample', 0)") for line in lines), proc.stdout
