"""Debug dumps: what each stage produced, as files a person can read, one folder per model.

``debug_dump_dir=DIR`` (or ``TESSERA_DEBUG_DUMP=DIR``) writes, under ``DIR/<prefix>/``:
``traced_graph.py`` (Dynamo's graph), ``computation_graph.py`` (the split graph),
``transformed_code.py`` (Dynamo's bytecode, decompiled with depyf when installed, else a
disassembly), ``pieces/<piece>_<size>.py`` (each artifact's code: Inductor's output code) and
``cache_key_factors.json``. Every stage also appears in torch's structured trace (TORCH_TRACE).
"""

from __future__ import annotations

import dis
import json
import logging
import re
import types
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class Dumps:
    """Writes a model's dumps under ``root/<prefix>/`` (a failure to write is logged, never raised)."""

    def __init__(self, root: Path, prefix: str) -> None:
        self.path = root / prefix

    def write(self, name: str, text: str) -> None:
        target = self.path / name
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
        except OSError as e:
            log.warning("debug dump %s not written: %s", target, e)

    def traced_graph(self, code: str) -> None:
        self.write("traced_graph.py", "# Dynamo's traced graph (before the split)\n" + code)

    def split_graph(self, text: str) -> None:
        self.write("computation_graph.py", text)

    def factors(self, factors: dict[str, Any]) -> None:
        text = json.dumps(factors, indent=2, sort_keys=True, default=str)
        self.write("cache_key_factors.json", text + "\n")

    def transformed_code(self, code: types.CodeType) -> None:
        self.write("transformed_code.py", decompile(code))

    def piece(self, piece: str, size: str, source: str) -> None:
        name = re.sub(r"[^A-Za-z0-9_]+", "_", f"{piece}_{size}").strip("_")
        self.write(f"pieces/{name}.py", source)


def decompile(code: types.CodeType) -> str:
    """Dynamo's transformed bytecode as Python (depyf, the ``debug`` extra), else a disassembly."""
    try:
        import depyf

        decompiled: str = depyf.decompile(code)
        return "# Dynamo's transformed code, decompiled by depyf\n" + decompiled
    except Exception as e:  # not installed, or this bytecode is beyond it
        missing = isinstance(e, ImportError)
        reason = "depyf is not installed (pip install tessera[debug])" if missing else str(e)
        return f"# Dynamo's transformed code as a disassembly: {reason}\n" + dis.Bytecode(code).dis()
