"""How many graphs ``generate()`` needs: tessera's traces against stock ``torch.compile``'s graphs.

Tiny random Llama, Qwen2, Mistral (sliding window) and Gemma 3 (the test suite's models), greedy
``generate()`` at batches 1..8 and prompt lengths 1..64, left-padded and not, 5 new tokens, with
the default (dynamic) cache and the static cache. Three ways to compile, each in a fresh process:
stock ``torch.compile(model.forward)`` (Dynamo's recompile limit raised so that its real count
shows), ``hf.compile_for_generate`` (``preset``) and ``model.forward = tessera.compile(...)``
(``idiom``). Every generation is compared with eager's; a refused one is counted as refused.

Prints JSON: one row per family, cache and way (graphs or traces, refused, differing), and a table
per family. Run: ``python -m benchmarks.generate_traces [--families llama] [--backend eager]``.
The eager compiler by default: the graph count does not depend on the compiler, and Inductor on a
small CPU takes minutes per family.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import subprocess
import sys
from typing import Any

from benchmarks import header

FAMILIES = ("llama", "qwen2", "mistral", "gemma3")
CACHES = ("default", "static")
WAYS = ("stock", "preset", "idiom")


def calls() -> list[tuple[int, int]]:
    """(batch, prompt length) of each generation: the corners, then a fixed random sample."""
    pick = random.Random(0)
    lengths = (1, 2, 3, 5, 8, 13, 21, 34, 64)
    sample = [(pick.randint(1, 8), pick.choice(lengths)) for _ in range(14)]
    return [(1, 8), (2, 9), *sample, (8, 64), (1, 1)]


def _generations(model: Any) -> list[Any]:
    import torch

    import tessera

    out: list[Any] = []
    for i, (batch, length) in enumerate(calls()):
        ids = torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(i))
        mask = torch.ones_like(ids)
        if batch > 1 and length > 2 and i % 2 == 0:  # left padding on every other padded prompt
            ids[0, : length // 2], mask[0, : length // 2] = 0, 0
        options = {"attention_mask": mask} if batch > 1 else {}
        try:
            out.append(model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, **options))
        except tessera.TesseraError as e:
            out.append(e)
    return out


def child(family: str, cache: str, way: str, backend: str) -> dict[str, Any]:
    """One family, cache and way in this process."""
    import torch

    import tessera
    from tessera import hf

    # The test suite's tiny models (imported by name: tests/ is not type-checked as a package).
    build = importlib.import_module("tests.test_hf").build
    model, _ = build(family)
    model.requires_grad_(False)
    if cache != "default":
        model.generation_config.cache_implementation = cache
    expected = _generations(model)
    graphs = 0
    compiled = None
    if way == "stock":

        def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            nonlocal graphs
            graphs += 1
            return gm.forward

        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.accumulated_recompile_limit = 1024
        model.forward = torch.compile(model.forward, backend=counting)
    elif way == "idiom":
        compiled = tessera.compile(model.forward, backend=backend)
        model.forward = compiled
    else:
        (compiled,) = hf.compile_for_generate(model, backend=backend).models
    got = _generations(model)
    refused = [i for i, g in enumerate(got) if isinstance(g, Exception)]
    differs = [
        i
        for i, (g, e) in enumerate(zip(got, expected, strict=True))
        if i not in refused and not torch.equal(g, e)
    ]
    row: dict[str, Any] = {
        "family": family,
        "cache": cache,
        "way": way,
        "refused": refused,
        "differs": differs,
    }
    row["graphs" if compiled is None else "traces"] = graphs if compiled is None else len(compiled.traces)
    if refused:
        row["first_refusal"] = str(got[refused[0]]).splitlines()[0][:300]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--child", nargs=4, metavar=("FAMILY", "CACHE", "WAY", "BACKEND"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    rows = []
    for family in args.families:
        for cache in CACHES:
            for way in WAYS:
                command = [sys.executable, "-m", "benchmarks.generate_traces", "--child", family, cache, way]
                proc = subprocess.run(
                    [*command, args.backend],
                    check=False,
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
                if proc.returncode != 0:
                    error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                    rows.append({"family": family, "cache": cache, "way": way, "error": error[:300]})
                else:
                    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), file=sys.stderr)
    table = {
        family: {
            f"{r['cache']} {r['way']}": r.get("graphs", r.get("traces", r.get("error")))
            for r in rows
            if r["family"] == family
        }
        for family in args.families
    }
    report = {
        **header("generate_traces"),
        "backend": args.backend,
        "generations": len(calls()),
        "table": table,
        "rows": rows,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
