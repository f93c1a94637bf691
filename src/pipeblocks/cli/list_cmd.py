"""`pipeblocks list`: schedule names and one-line descriptions."""
from __future__ import annotations

import argparse

from ..schedules import specs
from .common import print_json


def register(sub) -> None:
    parser = sub.add_parser("list", help="list the registered schedules")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    rows = [(spec.name, spec.summary) for spec in specs().values()]
    if args.json:
        print_json([{"name": n, "summary": s} for n, s in rows])
        return 0
    width = max(len(n) for n, _ in rows)
    for name, summary in rows:
        print(f"{name:<{width}}  {summary}")
    return 0
