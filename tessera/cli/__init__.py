"""The ``tessera`` command line: the demo, reports and cache tools (each a subcommand).

Only this package prints; the library logs. The benchmarks are not commands: they live in the
source repository (``python -m benchmarks.<name>``), which the wheel does not ship.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Trace a PyTorch model once, split it at attention, compile the pieces, start warm.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what tessera does")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="compile the toy Llama, check it against eager, time it")
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--hidden", type=int, default=256)
    demo.add_argument("--backend", default="inductor", choices=["inductor", "eager"])

    report = sub.add_parser("report", help="the compile record of a cache entry or a script's models")
    report.add_argument(
        "target", nargs="?", help="a cache entry directory or a Python script (default: newest)"
    )
    report.add_argument("--json", action="store_true", help="print the record as JSON")
    report.add_argument(
        "--html", metavar="PATH", help="write the record as a picture (timeline, sizes served) to PATH"
    )
    report.add_argument("--root", help="cache root (default: $TESSERA_CACHE_DIR or the user cache dir)")

    bisect = sub.add_parser("bisect", help="run a script; compare each compiled piece with eager")
    bisect.add_argument("script", help="a Python script that compiles and calls models")
    bisect.add_argument("--atol", type=float, default=1e-4)
    bisect.add_argument("--rtol", type=float, default=1e-4)

    cache = sub.add_parser("cache", help="inspect and manage the persistent compile cache")
    cache.add_argument("--root", help="cache root (default: $TESSERA_CACHE_DIR or the user cache dir)")
    cache_sub = cache.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    cache_sub.add_parser("ls", help="list entries: prefix, key, size, created, last used, pieces")
    explain = cache_sub.add_parser("explain", help="why the newest entry (or a script's) missed")
    explain.add_argument("--script", help="run this Python script first, then explain its miss")
    explain.add_argument("entry", nargs="?", help="an entry directory (default: the newest)")
    cache_sub.add_parser("verify", help="check every checksum; exit 1 on damage")
    cache_sub.add_parser("clear", help="remove every entry not in use")
    prune = cache_sub.add_parser("prune", help="remove least recently used entries down to a size")
    prune.add_argument("--max-size", required=True, help="e.g. 500M, 2G")
    export = cache_sub.add_parser("export", help="write entries and their pointers to a tar archive")
    export.add_argument("archive", help="FILE.tar")
    export.add_argument("--prefix", action="append", default=[], help="only entries with this prefix")
    export.add_argument("--key", action="append", default=[], help="only entries whose key starts so")
    imported = cache_sub.add_parser("import", help="bring an exported archive's entries into the root")
    imported.add_argument("archive", help="FILE.tar")

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command == "demo":
        from tessera.cli.demo import run_demo

        return run_demo(layers=args.layers, hidden=args.hidden, backend=args.backend)
    if args.command == "cache":
        return cache_command(args)
    if args.command == "report":
        from tessera.cache.entry import cache_root
        from tessera.cli.report import report_command

        return report_command(args.target, cache_root(args.root), args.json, args.html)
    if args.command == "bisect":
        return bisect_command(args.script, args.atol, args.rtol)
    parser.print_help(sys.stdout)
    return 0


def bisect_command(script: str, atol: float, rtol: float) -> int:
    """Run ``script``, then bisect every model it compiled on that model's first call."""
    from tessera.cli.report import run_script
    from tessera.debug import bisect

    models = [m for m in run_script(script) if m.first_call is not None]
    if not models:
        print(f"{script} compiled and called no model", file=sys.stderr)
        return 1
    status = 0
    for model in models:
        args, kwargs = model.first_call
        result = bisect(model.model, model, *args, atol=atol, rtol=rtol, **kwargs)
        print(f"== {model.name}")
        for line in result.format():
            print(line)
        status = status or int(result.first_bad is not None)
    return status


def cache_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tessera.cache import explain as cache_explain, tools as cachetools
    from tessera.cache.entry import cache_root

    root = cache_root(args.root)
    action = args.cache_command
    if action == "ls":
        infos = [cachetools.entry_info(p) for p in cachetools.find_entries(root)]
        print(f"cache root {root}: {len(infos)} entr{'y' if len(infos) == 1 else 'ies'}")
        if infos:
            header = f"  {'prefix':<14} {'key':<12} {'rank':<9} {'size':>10}  {'created':<16} "
            print(header + f"{'last used':<16} pieces")
        for e in infos:
            sizes = ",".join(e.sizes) or "-"
            print(
                f"  {e.prefix:<14} {e.key:<12} {e.rank:<9} {cachetools.human_bytes(e.size_bytes):>10}  "
                f"{stamp(e.created):<16} {stamp(e.last_used):<16} {e.pieces} ({sizes})"
            )
        return 0
    if action == "explain":
        if args.script:
            import runpy

            os.environ["TESSERA_CACHE_DIR"] = str(root)
            runpy.run_path(args.script, run_name="__main__")
        for line in cache_explain.explain(root, Path(args.entry) if args.entry else None):
            print(line)
        return 0
    if action == "verify":
        problems = cachetools.verify(root)
        strays = cachetools.stray_temp_files(root)
        entries = len(cachetools.find_entries(root))
        for problem in problems:
            print(f"{'UNTRUSTED' if ': not trusted' in problem else 'DAMAGED'} {problem}")
        for stray in strays:
            print(f"STRAY {stray} (a temp file of a process that is gone; clear or prune removes it)")
        print(
            f"{entries} entr{'y' if entries == 1 else 'ies'} checked, {len(problems)} problem(s), "
            f"{len(strays)} stray temp file(s)"
        )
        return 1 if problems else 0
    if action == "clear":
        print(f"removed {cachetools.clear(root)} entries from {root}")
        return 0
    if action in ("export", "import"):
        from tessera.cache import archive
        from tessera.errors import CacheError

        try:
            if action == "export":
                count = archive.export(root, Path(args.archive), args.prefix, args.key)
                print(f"exported {count} entr{'y' if count == 1 else 'ies'} from {root} to {args.archive}")
            else:
                count = archive.import_(root, Path(args.archive))
                print(f"imported {count} entr{'y' if count == 1 else 'ies'} into {root}")
        except (CacheError, OSError) as e:
            print(f"tessera cache {action}: {e}", file=sys.stderr)
            return 1
        return 0
    if action == "prune":
        try:
            limit = cachetools.parse_size(args.max_size)
        except ValueError as e:
            print(f"tessera cache prune: {e}", file=sys.stderr)
            return 2
        removed = cachetools.prune(root, limit)
        for path in removed:
            print(f"removed {path}")
        print(f"{len(removed)} entr{'y' if len(removed) == 1 else 'ies'} removed; limit {args.max_size}")
        return 0
    return 2


def stamp(seconds: float) -> str:
    """A file time as ``YYYY-MM-DD HH:MM`` (local time)."""
    from datetime import datetime

    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M")
