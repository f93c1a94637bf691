"""`pipeblocks <command>`: the command-line interface.

Each command is a module in this package with `register(subparsers)` (which adds its
parser and sets `run`) and `run(args) -> int`. User errors (ValueError, OSError on a
named file) print one line and exit 2, with no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "COMMANDS"]

COMMANDS = ("list_cmd", "show", "simulate_cmd", "compare", "plot", "export", "train")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeblocks", description="Pipeline-parallel schedules: list, show, simulate, compare, plot, train."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except (ValueError, OSError) as err:
        print(f"pipeblocks {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
