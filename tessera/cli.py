"""The ``tessera`` command line: demo, benchmark and cache tools (each a subcommand).

Only this module and ``demo`` print; the library logs.
"""

from __future__ import annotations

import argparse
import logging
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

    bench = sub.add_parser("bench", help="steady-state latency benchmark (JSON on stdout)")
    bench.add_argument("--quick", action="store_true", help="fewer repeats")

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command == "demo":
        from tessera.demo import run_demo

        return run_demo(layers=args.layers, hidden=args.hidden, backend=args.backend)
    if args.command == "bench":
        from tessera.bench.steady_state import main as bench_main

        return bench_main(quick=args.quick)
    parser.print_help(sys.stdout)
    return 0
