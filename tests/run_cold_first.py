"""Subprocess helper: a first call on a fresh interpreter, cold or warm (by its cache root), with
the background compile on; prints JSON: the stage the first output left, the tessera modules
imported when its trace thread started (a cold first call is answered before the machinery is
imported), the warm start, and calls of other sizes after every compile, each equal to eager's.

Usage: python -m tests.run_cold_first BACKEND
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import tessera
from tessera import counters
from tessera.compilation import background
from tessera.models import toy_llama


def main() -> None:
    started: list[list[str]] = []  # the tessera modules imported when each background thread starts
    original = background.start_thread

    def recording(*args: Any, **kwargs: Any) -> Any:
        started.append(sorted(m for m in sys.modules if m.startswith("tessera.")))
        return original(*args, **kwargs)

    background.start_thread = recording  # type: ignore[assignment]
    torch.manual_seed(0)
    model = toy_llama.build(num_layers=1)
    compiled = tessera.compile(model, backend=sys.argv[1])
    args = toy_llama.example_inputs(6)
    torch.testing.assert_close(compiled(*args), model(*args))
    stage = compiled.stage.value
    assert compiled.wait_ready(600), "the background compile did not finish"
    for n in (6, 9, 3):
        args = toy_llama.example_inputs(n)
        torch.testing.assert_close(compiled(*args), model(*args), msg=f"{n} tokens")
    result = {
        "stage_after_first": stage,
        "modules_when_the_trace_started": started[0] if started else None,
        "warm_start": compiled.warm_start,
        "traces": len(compiled.traces),
        "counters": counters.snapshot(),
    }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
