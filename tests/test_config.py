from __future__ import annotations

import pytest

from tessera import CompileConfig, ConfigError, SizeRange
from tessera.cache.key import config_record


def test_defaults_are_piecewise_inductor():
    config = CompileConfig()
    assert (config.mode, config.backend, config.cudagraph_mode) == ("piecewise", "inductor", "none")
    assert config.compile_sizes == () and config.ranges == ()


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"mode": "fast"}, "mode='fast' is unknown"),
        ({"backend": "tvm"}, "backend='tvm' is unknown"),
        ({"compile_sizes": [-1]}, "must be >= 1"),
        ({"compile_sizes": [0]}, "must be >= 1"),
        ({"compile_sizes": [2**40]}, "fits in memory"),
        ({"cudagraph_capture_sizes": [2**33]}, "fits in memory"),
        ({"compile_sizes": [8, 4]}, "sorted ascending"),
        ({"compile_sizes": [4, 4]}, "sorted ascending"),
        ({"compile_ranges": [32, 8]}, "sorted ascending"),
        ({"compile_ranges": [0]}, "must be >= 1"),
        ({"compile_sizes": [128], "max_size": 64}, "above max_size=64"),
        ({"compile_ranges": [128], "max_size": 64}, "above max_size=64"),
        ({"max_size": 0}, "positive integer"),
        ({"cudagraph_mode": "all"}, "cudagraph_mode='all'"),
    ],
)
def test_invalid_fields_raise_config_error(fields, words):
    with pytest.raises(ConfigError, match=words):
        CompileConfig(**fields)


def test_ranges_from_endpoints():
    assert CompileConfig(compile_ranges=[8, 32]).ranges == (
        SizeRange(1, 8),
        SizeRange(9, 32),
        SizeRange(33, None),
    )
    assert CompileConfig(compile_ranges=[8, 32], max_size=32).ranges == (SizeRange(1, 8), SizeRange(9, 32))
    assert 33 in SizeRange(33, None) and 8 not in SizeRange(9, 32)


def test_environment_replaces_defaults_but_not_explicit_values(monkeypatch):
    monkeypatch.setenv("TESSERA_BACKEND", "eager")
    monkeypatch.setenv("TESSERA_COMPILE_SIZES", "1, 8")
    config = CompileConfig()
    assert config.backend == "eager" and config.compile_sizes == (1, 8)
    assert CompileConfig(backend="inductor").backend == "inductor"


def test_bad_environment_value_is_a_config_error(monkeypatch):
    monkeypatch.setenv("TESSERA_MAX_SIZE", "lots")
    with pytest.raises(ConfigError, match="TESSERA_MAX_SIZE"):
        CompileConfig()


def test_disable_cache_environment_switch_wins(monkeypatch):
    monkeypatch.setenv("TESSERA_DISABLE_CACHE", "1")
    assert CompileConfig(disable_cache=False).disable_cache


def test_hash_covers_code_changing_fields_only():
    base = CompileConfig()
    assert config_record(base) == config_record(CompileConfig())
    assert config_record(base).digest != config_record(CompileConfig(compile_sizes=[4])).digest
    assert (
        config_record(base).digest
        != config_record(CompileConfig(inductor_config={"max_autotune": False})).digest
    )
    assert config_record(base).digest == config_record(CompileConfig(cache_dir="/elsewhere")).digest


def test_replace_rejects_unknown_fields():
    with pytest.raises(ConfigError, match="unknown CompileConfig field"):
        CompileConfig().replace(compile_size=[1])
