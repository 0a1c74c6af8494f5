"""``tessera report``: the compile record of a cache entry or of the models a script compiled.

Rendered with ``rich`` tables; ``--json`` prints ``CompileReport.as_dict()`` for machines.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path
from typing import Any

from tessera.cache.tools import find_entries, human_bytes


def load_entry_reports(entry: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The latest record of an entry (a warm start's if any, else the cold one) and the cold one."""

    def read(kind: str) -> dict[str, Any] | None:
        try:
            data = json.loads((entry / f"report-{kind}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    cold, warm = read("cold"), read("warm")
    return (warm or cold), cold


def run_script(script: str) -> list[Any]:
    """Run ``script`` and return the compiled models it created (with their first calls)."""
    from tessera import api

    recorded: list[Any] = []
    api.RECORDER = recorded
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        api.RECORDER = None
    return recorded


def render(report: dict[str, Any], cold: dict[str, Any] | None = None) -> None:
    """A report as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=sys.stdout, width=120)
    console.print(
        f"[bold]{report['model']}[/bold]: {report['kind']} start in {report['total_seconds']:.2f}s "
        f"(mode {report['mode']}, compiler {report['backend']}; {report['pieces']} pieces, "
        f"{report['compiled_pieces']} compiled)"
    )
    console.print(f"cache entry: {report['cache_entry'] or 'disabled'}")
    console.print(f"whole-model artifact: {report['whole_model_artifact']}")
    if report.get("background", "none") != "none":
        ready = report.get("all_sizes_ready_seconds")
        console.print(
            f"first output after {report['total_seconds']:.2f}s; sizes and ranges compiled after it: "
            f"{report['background']}" + (f", every size ready at {ready:.2f}s" if ready is not None else "")
        )
    if cold is not None and report["kind"] != "cold":
        console.print(
            f"this entry's cold start took {cold['total_seconds']:.2f}s "
            f"({_sum(cold, 'compiled')} artifact(s) compiled); this start {report['total_seconds']:.2f}s"
        )
    phases = Table(title="phases")
    phases.add_column("phase")
    phases.add_column("seconds", justify="right")
    for name, seconds in report["phases"].items():
        phases.add_row(name, f"{seconds:.3f}")
    console.print(phases)
    table = Table(title="artifacts")
    for column, justify in (
        ("piece", "left"),
        ("size", "left"),
        ("how", "left"),
        ("seconds", "right"),
        ("bytes", "right"),
        ("calls served", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for a in report["artifacts"]:
        size = human_bytes(a["bytes"]) if a["bytes"] else "-"
        # A report written before compile workers existed has no "worker" field.
        source = f"{a['source']} (worker)" if a.get("worker") is not None else a["source"]
        table.add_row(a["piece"], a["size"], source, f"{a['seconds']:.3f}", size, str(a["served"]))
    total = sum(a["seconds"] for a in report["artifacts"])
    table.add_row(
        "total", "", "", f"{total:.3f}", human_bytes(sum(a["bytes"] for a in report["artifacts"])), ""
    )
    console.print(table)
    if report.get("graphs"):
        graphs = Table(title="graphs (Dynamo's guards kept: the model has graph breaks)")
        for column in ("graph", "ends", "where", "nodes", "pieces"):
            # The source line is what the reader looks for: fold it, never cut it with an ellipsis.
            graphs.add_column(column, overflow="fold")
        for g in report["graphs"]:
            ends = f"graph break: {g['reason']}" if g["graph_break"] else f"frame ends ({g['reason']})"
            where = short_source(g["source"])
            graphs.add_row(str(g["index"]), ends, where, str(g["nodes"]), str(g["pieces"]))
        console.print(graphs)
    if report["counters"]:
        console.print("counters: " + ", ".join(f"{k}={v}" for k, v in report["counters"].items()))


def short_source(source: str) -> str:
    """``/long/path/pkg/file.py:22 in f`` as ``pkg/file.py:22 in f`` (relative to the cwd if under it)."""
    path, sep, rest = source.partition(":")
    if not sep or not path.startswith("/"):
        return source
    try:
        shown = str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        shown = "/".join(Path(path).parts[-2:])
    return f"{shown}:{rest}"


def _last_report_time(entry: Path) -> float:
    return max((f.stat().st_mtime for f in entry.glob("report-*.json")), default=0.0)


def _sum(report: dict[str, Any], source: str) -> int:
    return sum(1 for a in report["artifacts"] if a["source"] == source)


def report_command(target: str | None, root: Path, as_json: bool, html: str | None = None) -> int:
    if target is not None and target.endswith(".py"):
        models = [m for m in run_script(target) if m.report is not None]
        reports = [m.report.as_dict() for m in models]
        if html is not None:
            return write_html(html, reports)
        if as_json:
            print(json.dumps(reports, indent=1))
        else:
            for report in reports:
                render(report)
        return 0 if reports else 1
    if target is not None:
        entry = Path(target)
    else:
        entries = find_entries(root)
        if not entries:
            print(f"no cache entries under {root}", file=sys.stderr)
            return 1
        entry = max(entries, key=_last_report_time)
    latest, cold = load_entry_reports(entry)
    if latest is None:
        print(f"{entry}: no compile record (it is written at a model's first call)", file=sys.stderr)
        return 1
    if html is not None:
        return write_html(html, [latest])
    if as_json:
        print(json.dumps(latest, indent=1))
    else:
        render(latest, cold)
    return 0


def write_html(path: str, reports: list[dict[str, Any]]) -> int:
    """The reports as one HTML page at ``path`` (see picture.py)."""
    from tessera.cli.picture import render_html

    if not reports:
        print("no compiled model to draw", file=sys.stderr)
        return 1
    try:
        Path(path).write_text(render_html(reports), encoding="utf-8")
    except OSError as e:
        print(f"cannot write {path}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({len(reports)} model(s))")
    return 0
