"""Test helpers: run a function in a thread of its own (a thread's own priority, OpenMP count);
a stream of toy Llama calls with gaps until a model's background compile is done."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tessera.models import toy_llama


def in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()``'s result, called in a new thread."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def stream_until_ready(
    compiled: Any,
    model: torch.nn.Module,
    during: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    timeout: float = 300.0,
) -> None:
    """Call ``compiled`` (a toy Llama) with varied token counts and a 10 ms gap between calls, as a
    service sees, until it is ready; each output must equal the model's own. ``during()`` is entered
    around each compiled call."""
    deadline = time.monotonic() + timeout
    for n in itertools.cycle([5, 8, 11, 6, 9]):
        if compiled.ready:
            return
        assert time.monotonic() < deadline, "the background compile did not finish"
        args = toy_llama.example_inputs(n)
        stage = compiled.stage.value
        with during():
            got = compiled(*args)
        torch.testing.assert_close(got, model(*args), msg=f"{n} tokens, stage {stage}")
        time.sleep(0.01)  # the gap between requests, not a wait for anything
