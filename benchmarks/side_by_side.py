"""Two source trees side by side: each tree's own benchmarks, interleaved, in one run; JSON out.

Whether a change (a refactor, say) moved performance: the benchmarks of the tree under ``--base``
(another checkout, e.g. ``git archive <commit> | tar -x -C DIR``) and of this repository run in
turn on the same machine, and every headline figure is reported per tree as the median over the
rounds, with each round's value, its spread, and the ratio current / base of the medians.

Each benchmark runs as ``python -m benchmarks.<name>`` from the tree's root with ``PYTHONPATH``
set to that root alone, so that it measures that tree's tessera (its own children inherit the
root first, ``benchmarks.child_env``). The trees alternate within a round, and the tree that goes
first alternates from round to round, so that drift on the machine falls on both alike. Every run
gets empty tessera and Inductor cache directories of its own (``startup`` also makes its own for
the processes it measures).

Figures:

- ``startup``: process start to first output for eager and for tessera, warm (medians within the
  run) and cold (one run each), and tessera's warm-start overhead over eager (median of the
  run's paired differences). Stock ``torch.compile`` warm is kept as a control: it runs no tessera
  code, so a difference there is the machine's.
- ``steady_state``: per-call latency of the 4-layer Inductor toy Llama (section ``inductor``) and
  the dispatch overhead of tessera with the eager compiler (section ``dispatch_overhead``), per
  number of tokens. Eager and stock are controls in the same way.

Run: ``python -m benchmarks.side_by_side --base DIR [--rounds 3] [--benchmarks startup
steady_state] [--models toy4] [--repeats 3] [--full] [--env NAME=VALUE ...]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import ROOT, header

BENCHMARKS = ("startup", "steady_state")
STEADY_SECTIONS = ("dispatch_overhead", "inductor")
TREES = ("base", "current")


# -- the headline figures of one run ----------------------------------------------------------------
def startup_figures(report: dict[str, Any]) -> dict[str, float]:
    """Per model: eager and tessera (cold, warm, warm overhead), stock warm as a control."""
    out: dict[str, float] = {}
    for result in report["results"]:
        prefix = f"startup.{result['model']}"
        medians = result["seconds_median"]
        out[f"{prefix}.eager_s"] = medians["eager"]
        out[f"{prefix}.tessera_warm_s"] = medians["tessera_warm"]
        out[f"{prefix}.tessera_cold_s"] = medians["tessera_cold"]
        out[f"{prefix}.tessera_warm_overhead_s"] = result["warm_overhead_seconds"]["tessera"]
        out[f"{prefix}.control.stock_warm_s"] = medians["stock_warm"]
    return out


def steady_state_figures(report: dict[str, Any]) -> dict[str, float]:
    """Per number of tokens: tessera's per-call latency (Inductor) and dispatch overhead (eager
    compiler), with eager and stock as controls; the input check alone."""
    out: dict[str, float] = {}
    for row in report["inductor"]["rows"]:
        prefix = f"inductor.tokens_{row['tokens']}"
        out[f"{prefix}.tessera_ms"] = row["tessera_ms"]
        out[f"{prefix}.tessera_over_eager"] = row["tessera_over_eager"]
        out[f"{prefix}.tessera_over_stock"] = row["tessera_over_stock"]
        out[f"{prefix}.control.eager_ms"] = row["eager_ms"]
        out[f"{prefix}.control.stock_compile_ms"] = row["stock_compile_ms"]
    dispatch = report["dispatch_overhead"]
    for row in dispatch["rows"]:
        prefix = f"dispatch_overhead.tokens_{row['tokens']}"
        out[f"{prefix}.tessera_eager_ms"] = row["tessera_eager_ms"]
        out[f"{prefix}.tessera_eager_unchecked_ms"] = row["tessera_eager_unchecked_ms"]
        out[f"{prefix}.tessera_over_eager"] = row["tessera_over_eager"]
        out[f"{prefix}.check_cost_us"] = row["check_cost_us"]
        out[f"{prefix}.control.eager_ms"] = row["eager_ms"]
    out["dispatch_overhead.check_alone_us"] = dispatch["check_alone_us"]
    out["dispatch_overhead.check_assumptions"] = dispatch["check_assumptions"]
    return out


FIGURES: dict[str, Callable[[dict[str, Any]], dict[str, float]]] = {
    "startup": startup_figures,
    "steady_state": steady_state_figures,
}


# -- the runs ---------------------------------------------------------------------------------------
def arguments(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each benchmark's own command-line arguments, the same for both trees."""
    steady = ["--sections", *STEADY_SECTIONS]
    return {
        "startup": ["--models", *args.models, "--repeats", str(args.repeats)],
        "steady_state": steady if args.full else ["--quick", *steady],
    }


def run_one(root: str, benchmark: str, argv: list[str], extra_env: dict[str, str]) -> dict[str, Any]:
    """One benchmark from one tree's root, in a fresh process with empty caches: its JSON report
    and the run's wall seconds and load averages."""
    with tempfile.TemporaryDirectory(prefix="tessera-side-by-side-") as scratch:
        env = {
            **os.environ,
            **extra_env,
            "PYTHONPATH": root,
            "TESSERA_CACHE_DIR": str(Path(scratch, "tessera")),
            "TORCHINDUCTOR_CACHE_DIR": str(Path(scratch, "inductor")),
        }
        cmd = [sys.executable, "-m", f"benchmarks.{benchmark}", *argv]
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{benchmark} in {root} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(proc.stdout)
    return {"report": report, "wall_seconds": seconds, "load_1min": [load_before, os.getloadavg()[0]]}


def summary(values: list[float]) -> dict[str, Any]:
    """The median of the rounds, each round's value, and the spread: max - min over the median."""
    median = statistics.median(values)
    spread = (max(values) - min(values)) / abs(median) if median else None
    return {"median": median, "rounds": values, "spread": spread}


def tree_info(root: str) -> dict[str, Any]:
    """The tree's root and, where it is a git checkout, its commit and uncommitted files."""
    info: dict[str, Any] = {"root": root, "tessera_digest": source_digest(root)}

    def git(*argv: str) -> str | None:
        cmd = ["git", "--no-optional-locks", "-C", root, *argv]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None

    if git("rev-parse", "--show-toplevel") == str(Path(root).resolve()):
        info["commit"] = git("rev-parse", "HEAD")
        info["uncommitted"] = (git("diff", "--name-only", "HEAD") or "").splitlines()
    return info


def script_digest(root: str, benchmark: str) -> str:
    return hashlib.sha256(Path(root, "benchmarks", f"{benchmark}.py").read_bytes()).hexdigest()[:16]


def source_digest(root: str) -> str:
    """The tessera sources a run of this tree measures: a tree edited during the comparison shows
    as runs of one tree with different digests."""
    digest = hashlib.sha256()
    package = Path(root, "tessera")
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--base", required=True, help="the other source tree's root")
    parser.add_argument("--base-label", help="what the base tree is (e.g. the commit it was taken from)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--benchmarks", nargs="*", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--models", nargs="*", default=["toy4"], help="startup's models")
    parser.add_argument("--repeats", type=int, default=3, help="startup's warm runs per model")
    parser.add_argument("--full", action="store_true", help="steady_state without --quick")
    parser.add_argument(
        "--env",
        nargs="*",
        default=[],
        metavar="NAME=VALUE",
        help="set in every run of both trees (e.g. TESSERA_BACKGROUND_COMPILE=0)",
    )
    args = parser.parse_args(argv)
    extra_env = dict(item.split("=", 1) for item in args.env)
    roots = {"base": str(Path(args.base).resolve()), "current": ROOT}
    own_args = arguments(args)

    trees = {tree: tree_info(root) for tree, root in roots.items()}
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    values: dict[str, dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        order = TREES if round_ % 2 == 0 else TREES[::-1]
        for benchmark in args.benchmarks:
            for tree in order:
                digest = source_digest(roots[tree])
                run = run_one(roots[tree], benchmark, own_args[benchmark], extra_env)
                figures = FIGURES[benchmark](run["report"])
                for name, value in figures.items():
                    values.setdefault(name, {t: [] for t in TREES})[tree].append(value)
                runs.append(
                    {
                        "round": round_,
                        "benchmark": benchmark,
                        "tree": tree,
                        "tessera_digest": digest,
                        "wall_seconds": run["wall_seconds"],
                        "load_1min": run["load_1min"],
                        "figures": figures,
                    }
                )

    figures_out: dict[str, Any] = {}
    for name, per_tree in values.items():
        summaries = {tree: summary(per_tree[tree]) for tree in TREES}
        base = summaries["base"]["median"]
        ratio = summaries["current"]["median"] / base if base else None
        figures_out[name] = {**summaries, "current_over_base": ratio}
    result: dict[str, Any] = {
        **header("side_by_side"),
        # At the start; each run records the digest of the tessera sources it measured.
        "trees": trees,
        "base_label": args.base_label,
        "rounds": args.rounds,
        "arguments": {name: own_args[name] for name in args.benchmarks},
        "env": extra_env,
        "scripts_identical": {
            name: script_digest(roots["base"], name) == script_digest(roots["current"], name)
            for name in args.benchmarks
        },
        "figures": figures_out,
        "runs": runs,
        "wall_seconds": time.perf_counter() - started,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
