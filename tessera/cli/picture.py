"""``tessera report --html PATH``: a model's compile as a picture, one self-contained HTML file.

Two charts in inline SVG (no script, nothing fetched): the compile timeline (each trace and each
artifact of each piece on one time axis from the process's start, coloured by what it is for)
and the sizes served (a histogram, each bar split by the kind of artifact that served the calls);
then the table of every artifact with its file in the cache entry.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from typing import Any

WIDTH = 960
LEFT = 150  # room for row labels
RIGHT = 20
ROW = 22

# One colour per kind of artifact (what it was compiled for), in both charts.
COLOURS = {
    "eager": "#e45756",
    "trace": "#8c8c8c",
    "as traced": "#c7c7c7",
    "general": "#4c78a8",
    "range": "#f58518",
    "size": "#54a24b",
    "learnt size": "#b279a2",
}
KIND_NAMES = {
    "eager": "served eagerly (the model's forward, while a trace was made)",
    "trace": "trace (Dynamo)",
    "as traced": "as traced (eager kernels)",
    "general": "general (symbolic size)",
    "range": "size range",
    "size": "static size (listed)",
    "learnt size": "static size (learnt from traffic)",
}


def kind_of(label: str, learnt: Sequence[int] = ()) -> str:
    """The kind of an artifact label (``general``, ``general (as traced)``, ``size 16``, ...)."""
    if label.startswith("served eagerly"):
        return "eager"
    if label.startswith("trace"):
        return "trace"
    if label.endswith("(as traced)"):
        return "as traced"
    if label.startswith("range"):
        return "range"
    if label.startswith("size"):  # "size 8", or "size 8 (graph)": a CUDA graph replay of it
        size = label.split()[1]
        return "learnt size" if size.isdigit() and int(size) in learnt else "size"
    if label.startswith("shape"):  # "shape 4x128": only ever learnt from traffic
        return "learnt size"
    return "general"


def render_html(reports: Sequence[dict[str, Any]]) -> str:
    """One page for the ``reports`` (``CompileReport.as_dict()``), a section per model."""
    sections = "\n".join(_section(r) for r in reports)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>tessera compile report</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: {WIDTH + 40}px; }}
h1 {{ font-size: 20px; }} h2 {{ font-size: 17px; margin-top: 32px; }} h3 {{ font-size: 15px; }}
table {{ border-collapse: collapse; font-size: 12px; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 2px 8px; text-align: left; }}
td.n {{ text-align: right; font-variant-numeric: tabular-nums; }}
.legend span {{ display: inline-block; margin-right: 14px; }}
.legend i {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }}
svg text {{ font: 11px system-ui, sans-serif; fill: #333; }}
</style></head><body>
<h1>tessera compile report</h1>
{sections}
</body></html>
"""


def _section(report: dict[str, Any]) -> str:
    learnt = tuple(report.get("learnt_sizes", ()))
    title = html.escape(
        f"{report['model']}: {report['kind']} start, first output after {report['total_seconds']:.2f}s "
        f"({report['pieces']} pieces, {report['compiled_pieces']} compiled by {report['backend']})"
    )
    learnt_line = f"<p>Sizes learnt from traffic: {', '.join(map(str, learnt))}</p>" if learnt else ""
    return f"""<section>
<h2>{title}</h2>
<p>Cache entry: <code>{html.escape(str(report.get("cache_entry") or "disabled"))}</code>;
whole-model artifact {html.escape(str(report["whole_model_artifact"]))}.</p>
{learnt_line}
{_legend()}
<h3>Compile timeline (seconds from the process's start)</h3>
{_timeline(report.get("timeline", ()), learnt)}
<h3>Sizes served, by the artifact that served them</h3>
{_histogram(report.get("sizes_served", ()), learnt)}
<h3>Artifacts</h3>
{_artifacts(report["artifacts"])}
</section>"""


def _legend() -> str:
    items = "".join(
        f'<span><i style="background:{COLOURS[k]}"></i>{html.escape(name)}</span>'
        for k, name in KIND_NAMES.items()
    )
    return f'<p class="legend">{items}</p>'


def _ticks(top: float, count: int = 8) -> list[float]:
    """Round axis ticks from 0 to at least ``top``."""
    if top <= 0:
        return [0.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(top / step) + 2)]


def _timeline(spans: Sequence[dict[str, Any]], learnt: Sequence[int]) -> str:
    if not spans:
        return "<p>No compile in this process.</p>"
    rows: list[str] = []
    for span in spans:
        row = "traces" if not span["piece"] else span["piece"]
        if row not in rows:
            rows.append(row)
    ticks = _ticks(max(s["end"] for s in spans))
    scale = (WIDTH - LEFT - RIGHT) / ticks[-1]
    height = 30 + ROW * len(rows) + 20
    parts = [f'<svg width="{WIDTH}" height="{height}" role="img" aria-label="compile timeline">']
    for tick in ticks:
        x = LEFT + tick * scale
        parts.append(f'<line x1="{x:.1f}" y1="20" x2="{x:.1f}" y2="{height - 20}" stroke="#eee"/>')
        parts.append(f'<text x="{x:.1f}" y="{height - 6}" text-anchor="middle">{tick:g}s</text>')
    for i, row in enumerate(rows):
        parts.append(
            f'<text x="{LEFT - 8}" y="{30 + ROW * i + 12}" text-anchor="end">{html.escape(row)}</text>'
        )
    for span in spans:
        i = rows.index("traces" if not span["piece"] else span["piece"])
        x = LEFT + max(0.0, span["start"]) * scale
        width = max(2.0, (span["end"] - max(0.0, span["start"])) * scale)
        kind = kind_of(span["what"], learnt)
        opacity = "0.45" if span["source"] in ("loaded", "shared") else "1"
        tip = html.escape(
            f"{span['piece'] or 'trace'}: {span['what']}, {span['source']}, "
            f"{span['start']:.3f}s to {span['end']:.3f}s ({span['end'] - span['start']:.3f}s)"
        )
        parts.append(
            f'<rect x="{x:.1f}" y="{30 + ROW * i}" width="{width:.1f}" height="{ROW - 6}" '
            f'fill="{COLOURS[kind]}" fill-opacity="{opacity}" stroke="#fff" stroke-width="0.5">'
            f"<title>{tip}</title></rect>"
        )
    parts.append("</svg>")
    note = "<p>Faded bars were loaded from the cache or shared with an identical piece, not compiled.</p>"
    return "\n".join(parts) + note


def _size_name(size: tuple[int, ...]) -> str:
    return f"size {size[0]}" if len(size) == 1 else f"shape {'x'.join(map(str, size))}"


def _histogram(served: Sequence[Sequence[Any]], learnt: Sequence[int]) -> str:
    if not served:
        return "<p>No call with a size counted yet.</p>"
    by_size: dict[tuple[int, ...], dict[str, int]] = {}
    for size, label, calls in served:
        kinds = by_size.setdefault(tuple(size) if isinstance(size, list | tuple) else (int(size),), {})
        kind = kind_of(str(label), learnt)
        kinds[kind] = kinds.get(kind, 0) + int(calls)
    sizes = sorted(by_size)
    top = max(sum(k.values()) for k in by_size.values())
    ticks = _ticks(top, 5)
    plot = 220
    height = plot + 60
    slot = (WIDTH - LEFT - RIGHT) / len(sizes)
    bar = max(1.0, slot * 0.8)
    parts = [f'<svg width="{WIDTH}" height="{height}" role="img" aria-label="sizes served">']
    for tick in ticks:
        y = 20 + plot - tick / ticks[-1] * plot
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{LEFT - 8}" y="{y + 4:.1f}" text-anchor="end">{tick:g}</text>')
    parts.append(f'<text x="{LEFT - 60}" y="14">calls</text>')
    every = max(1, math.ceil(len(sizes) / 40))  # at most ~40 size labels under the axis
    for i, size in enumerate(sizes):
        x = LEFT + i * slot + (slot - bar) / 2
        y = 20 + plot
        for kind, colour in COLOURS.items():
            calls = by_size[size].get(kind, 0)
            if not calls:
                continue
            h = calls / ticks[-1] * plot
            y -= h
            tip = html.escape(f"{_size_name(size)}: {calls} call(s) served by {KIND_NAMES[kind]}")
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="{colour}">'
                f"<title>{tip}</title></rect>"
            )
        if i % every == 0:
            parts.append(
                f'<text x="{x + bar / 2:.1f}" y="{20 + plot + 14}" text-anchor="middle">'
                f"{'x'.join(map(str, size))}</text>"
            )
    parts.append(
        f'<text x="{(WIDTH + LEFT) / 2:.0f}" y="{height - 8}" text-anchor="middle">runtime size</text>'
    )
    parts.append("</svg>")
    return "\n".join(parts)


def _artifacts(artifacts: Sequence[dict[str, Any]]) -> str:
    if not artifacts:
        return "<p>None.</p>"
    rows = "".join(
        "<tr>"
        f"<td>{html.escape(str(a['piece']))}</td><td>{html.escape(str(a['size']))}</td>"
        f"<td>{html.escape(str(a['source']))}</td><td class=n>{float(a['seconds']):.3f}</td>"
        f"<td><code>{html.escape(str(a['file']) or '-')}</code></td><td class=n>{int(a['bytes'])}</td>"
        f"<td class=n>{int(a.get('served', 0))}</td>"
        "</tr>"
        for a in artifacts
    )
    return (
        "<table><tr><th>piece</th><th>for</th><th>obtained</th><th>seconds</th><th>file</th>"
        f"<th>bytes</th><th>calls served</th></tr>{rows}</table>"
    )
