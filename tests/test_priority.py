"""The compile worker processes run at ``background_priority`` (priority.py); this process's own
threads, the background compile among them, keep the caller's priority."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

import tessera
from tessera.compilation import priority
from tessera.errors import ConfigError
from tessera.models import toy_llama
from tests.custom_compiler import PriorityRecordingCompiler

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="read through Linux's per-thread nice"
)
RECORDING = "tests.custom_compiler:PriorityRecordingCompiler"


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _lowered_in_child(setting: str, refuse_idle: bool = False) -> tuple[bool, int, int]:
    script = f"""
import os
from tessera.compilation import priority
if {refuse_idle}:
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")
    os.sched_setscheduler = refuse
print(priority.lower_process({setting!r}), os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    lowered, nice, policy = out.stdout.split()
    return lowered == "True", int(nice), int(policy)


@linux_only
def test_a_compile_worker_lowers_itself_to_the_setting():
    assert _lowered_in_child("low") == (True, priority.LOW_NICE, os.SCHED_OTHER)
    assert _lowered_in_child("idle")[::2] == (True, os.SCHED_IDLE)
    # A sandbox that refuses SCHED_IDLE: nice 19 instead.
    assert _lowered_in_child("idle", refuse_idle=True) == (True, priority.LOW_NICE, os.SCHED_OTHER)
    assert _lowered_in_child("normal")[0] is False


def test_background_priority_is_checked(monkeypatch):
    assert tessera.CompileConfig().background_priority == "low"
    with pytest.raises(ConfigError, match="background_priority"):
        tessera.CompileConfig(background_priority="lowest")
    monkeypatch.setenv("TESSERA_BACKGROUND_PRIORITY", "high")
    with pytest.raises(ConfigError, match="TESSERA_BACKGROUND_PRIORITY"):
        tessera.CompileConfig()
    monkeypatch.setenv("TESSERA_BACKGROUND_PRIORITY", "idle")
    assert tessera.CompileConfig().background_priority == "idle"


@linux_only
@pytest.mark.parametrize("setting", ["low", "idle"])
def test_the_background_compile_in_this_process_keeps_the_callers_priority(monkeypatch, setting):
    # A lowered thread would pass its priority on to every thread it starts: Inductor's compile
    # pool among them, which the user's own later torch.compile would then run in.
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    PriorityRecordingCompiler.seen.clear()
    before = _nice()
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend=RECORDING, compile_sizes=[8], background_priority=setting)
    for n in (5, 8, 11):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, compiling")
    assert compiled.wait_ready(120)
    for n in (5, 8, 11):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, ready")
    seen = PriorityRecordingCompiler.seen
    assert any(s["thread"].startswith("tessera-compile") for s in seen), seen
    assert all(s["nice"] == s["child_nice"] == before for s in seen), seen
    assert all(s["policy"] == os.SCHED_OTHER for s in seen), seen
    assert _nice() == before and os.sched_getscheduler(0) == os.SCHED_OTHER
