"""`pipeblocks <command>`: the command-line interface.

Each command is a module in this package with `register(subparsers)` (which adds its
parser and sets `run`) and `run(args) -> int`. User errors (ValueError, OSError on a
named file) print one line and exit 2, with no traceback. Output cut short by its reader
(`pipeblocks show ... | head`) ends quietly with the status of a process killed by
SIGPIPE, as other command-line tools do.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time

from .. import __version__
from ..schedules import load_schedules

__all__ = ["main", "COMMANDS"]

COMMANDS = ("list_cmd", "show", "simulate_cmd", "compare", "plot", "export", "train", "plan", "calibrate")
BROKEN_PIPE_STATUS = 128 + 13  # 128 + SIGPIPE
RANK_ZERO_GRACE_S = 10.0  # under torchrun, how long a worker waits for rank 0 to report a shared error


class _Parser(argparse.ArgumentParser):
    """Errors in one line, like every other user error, instead of the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pipeblocks", description="Pipeline-parallel schedules: list, show, simulate, compare, plot, train."
    )
    parser.add_argument("--version", action="version", version=f"pipeblocks {__version__}")
    parser.add_argument("--schedules-from", action="append", default=[], metavar="MODULE",
                        help="a .py file or an importable module whose generators, marked with "
                             "@pipeblocks.schedules.register, every command then knows by name (before or after "
                             "the command; repeat it for several; docs/schedules.md)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__package__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, sources = _schedules_from(sys.argv[1:] if argv is None else list(argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or a bad option: a status, as for any other end
        return done.code if isinstance(done.code, int) else 2
    try:
        _load_schedules(sources)
    except ValueError as err:
        print(f"pipeblocks {args.command}: error: {err}", file=sys.stderr)
        return 2
    _show_progress()
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_STATUS
    except (ValueError, OSError) as err:
        if not _said_by_rank_zero():
            print(f"pipeblocks {args.command}: error: {err}", file=sys.stderr)
        else:
            # leave rank 0 time to say it: torchrun stops every worker at the first one's exit,
            # and rank 0, stopped before it printed, would leave the run failed without a word;
            # rank 0's own exit ends this wait (torchrun's SIGTERM)
            time.sleep(RANK_ZERO_GRACE_S)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _schedules_from(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without its --schedules-from options, their modules): the option may follow the
    command (`pipeblocks simulate NAME --schedules-from my.py`), where the command's own parser
    would not know it."""
    rest, sources, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--schedules-from" and i + 1 < len(argv):
            sources.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--schedules-from="):
            sources.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return rest, sources


def _load_schedules(sources: list[str]) -> None:
    """Register the generators of each module (the ranks `train` starts get the Schedule
    itself, built here; under torchrun every process reads the same command line)."""
    for source in sources:
        added = load_schedules(source)
        logging.getLogger("pipeblocks.schedules").info("schedules from %s: %s", source, ", ".join(added))


def _said_by_rank_zero() -> bool:
    """Under torchrun, an error found before the ranks met (bad input, checked alike by every
    process) is printed by global rank 0 alone; an error of a rank's own run is printed by it."""
    rank = os.environ.get("RANK")
    if rank in (None, "0") or "LOCAL_RANK" not in os.environ:
        return False
    dist = sys.modules.get("torch.distributed")
    return not (dist is not None and dist.is_available() and dist.is_initialized())


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the message (it may be replaced)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _show_progress() -> None:
    """Long builds report progress through the `pipeblocks` loggers; the command line shows
    it on stderr, so stdout stays clean for tables and JSON."""
    logger = logging.getLogger("pipeblocks")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _silence_stdout() -> None:
    """The reader is gone: point stdout at /dev/null so the interpreter's final flush of
    what is still buffered does not fail a second time."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass


if __name__ == "__main__":
    sys.exit(main())
