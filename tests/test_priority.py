"""Background work runs at a lower CPU priority than the calls a process serves (priority.py): the
trace made beside eager, the background compiles, and the processes they start."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

import tessera
from tessera import priority
from tessera.errors import ConfigError
from tessera.models import toy_llama
from tests.custom_compiler import PriorityRecordingCompiler
from tests.threads import in_thread

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a thread has a priority of its own on Linux only"
)
RECORDING = "tests.custom_compiler:PriorityRecordingCompiler"


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_only
def test_lowering_a_thread_leaves_the_others_and_normal_changes_nothing():
    before = _nice()

    def lowered() -> tuple[bool, int, int]:
        return priority.lower_thread("low"), _nice(), os.sched_getscheduler(0)

    assert in_thread(lowered) == (True, priority.LOW_NICE, os.SCHED_OTHER)
    assert _nice() == before  # the calling thread, and so the process's served calls, keep theirs

    def idle() -> tuple[bool, int]:
        return priority.lower_thread("idle"), os.sched_getscheduler(0)

    assert in_thread(idle) == (True, os.SCHED_IDLE)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER

    def normal() -> tuple[bool, int]:
        return priority.lower_thread("normal"), _nice()

    assert in_thread(normal) == (False, before)


@linux_only
def test_a_thread_whose_wakeups_must_not_preempt_is_sched_batch_at_its_own_nice_and_back():
    before = _nice(), os.sched_getscheduler(0)

    def batch_then_back() -> tuple[bool, int, int, bool, int]:
        off = priority.wakeup_preemption(False), os.sched_getscheduler(0), _nice()
        return (*off, priority.wakeup_preemption(True), os.sched_getscheduler(0))

    assert in_thread(batch_then_back) == (True, os.SCHED_BATCH, before[0], True, os.SCHED_OTHER)
    assert (_nice(), os.sched_getscheduler(0)) == before  # the calling thread keeps its own


@linux_only
def test_a_compile_worker_at_low_runs_at_sched_idle_and_at_nice_19_where_that_is_refused(monkeypatch):
    # It is stopped while a call is served (worker_pause.py) and holds no GIL of the server's: a
    # woken served thread then takes its core at once, where nice 19 lets it finish its slice.
    def lowered() -> tuple[bool, int, int]:
        return priority.lower_process("low"), os.sched_getscheduler(0), _nice()

    assert in_thread(lowered)[:2] == (True, os.SCHED_IDLE)

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    assert in_thread(lowered) == (True, os.SCHED_OTHER, priority.LOW_NICE)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER and _nice() != priority.LOW_NICE


def test_elsewhere_than_linux_a_thread_is_left_as_it_is(monkeypatch):
    # There a priority is the whole process's: lowering "one thread" would slow the served calls.
    monkeypatch.setattr(sys, "platform", "darwin")
    changed = []
    monkeypatch.setattr(os, "setpriority", lambda *a: changed.append(a), raising=False)
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: changed.append(a), raising=False)
    assert not priority.lower_thread("low") and not priority.lower_thread("idle")
    assert changed == []


def test_a_system_that_refuses_is_stepped_around(monkeypatch):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(os, "setpriority", refuse, raising=False)
    assert priority.lower_thread("low") is False


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
@pytest.mark.parametrize("setting", ["low", "idle", "normal"])
def test_the_background_compiles_and_their_processes_run_at_the_background_priority(monkeypatch, setting):
    monkeypatch.setenv("TESSERA_BACKGROUND_COMPILE", "1")
    PriorityRecordingCompiler.seen.clear()
    before = _nice()
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend=RECORDING, compile_sizes=[8], background_priority=setting)
    for n in (5, 8, 11):  # the first is served eagerly while the trace is made beside it
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, compiling")
    assert compiled.wait_ready(120)
    for n in (5, 8, 11):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens, ready")
    seen = PriorityRecordingCompiler.seen
    assert seen and all(s["thread"].startswith("tessera-") for s in seen), seen
    expected_nice = before if setting == "normal" else priority.LOW_NICE
    if setting == "idle":
        assert all(s["policy"] == os.SCHED_IDLE for s in seen), seen
    else:
        assert all(s["nice"] == s["child_nice"] == expected_nice for s in seen), seen
        assert all(s["policy"] == os.SCHED_OTHER for s in seen), seen
    assert _nice() == before and os.sched_getscheduler(0) == os.SCHED_OTHER
