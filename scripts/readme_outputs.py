"""Check (or rewrite) the outputs that README.md and the docs pages show against the commands they show.

    python scripts/readme_outputs.py                # check every deterministic block; exit 1 on a difference
    python scripts/readme_outputs.py --write        # rewrite those blocks from fresh runs
    python scripts/readme_outputs.py --train        # also run the `pipeblocks train` blocks (minutes)
    python scripts/readme_outputs.py docs/cli.md    # one page only

The pages checked by default are `PAGES`: README.md and the docs pages that quote command
output (docs/cli.md, docs/training.md, docs/schedules.md, docs/runtime.md, docs/pipemare.md).

A block is a ```text fence whose first line is `$ pipeblocks ...`: the command runs in this
process and its standard output is compared with the block. Blocks are compared by kind:

- plain commands (list, show, compare ...): the exact text;
- `--json` commands: the same JSON value (README may show it compact);
- `train`: the header, every shown step's loss, the held-out losses and the peak-memory
  table, which the seed fixes; times, tokens/s, the measured bubble and the notes on the
  machine's load vary from run to run and are left out.
  With --write, the first step line is cut after its loss and the steps between the first
  and the last are dropped, as README shows them.

A ```python fence in which a `print(...)` line is followed by a `# output` comment line is
run (in a scratch directory, so the files it writes stay out of the checkout) and each such
print's output is compared with its comment.

Commands that write files (`--plot F`, `-o F`) run in a scratch directory too when checking;
with --write they run in the checkout, so the pictures README links are redrawn as well.

README's schedule table (rows whose first cell is a schedule name in backquotes) is
checked against `pipeblocks compare -p 4 -m 8`: each row's three figures must be that
command's `vs 1F1B`, `bubble` and `span bub` for the schedule.
"""
from __future__ import annotations

import argparse
import builtins
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's pipeblocks, also without an install

__all__ = ["PAGES", "Block", "check", "check_schedule_table", "find_blocks", "run_command", "run_python"]

PAGES = ("README.md", "docs/cli.md", "docs/training.md", "docs/schedules.md", "docs/runtime.md", "docs/pipemare.md")

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_STEP = re.compile(r"^step\s+(\d+)/(\d+)\s+loss\s+(\S+)")
_TABLE_ROW = re.compile(r"^\| `([\w-]+)` \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", re.M)


@dataclass(frozen=True)
class Block:
    """One fenced block of README: where its body starts and ends (character offsets)."""

    language: str
    body: str
    start: int
    end: int

    @property
    def command(self) -> str | None:
        first = self.body.split("\n", 1)[0]
        return first[2:] if self.language == "text" and first.startswith("$ pipeblocks ") else None

    @property
    def shown(self) -> str:
        """The output part of a command block."""
        return self.body.split("\n", 1)[1] if "\n" in self.body else ""

    @property
    def kind(self) -> str:
        words = shlex.split(self.command or "")
        if words[1:2] == ["train"]:
            return "train"
        return "json" if "--json" in words else "text"


def find_blocks(text: str) -> list[Block]:
    return [Block(m.group(1), m.group(2), m.start(2), m.end(2)) for m in _FENCE.finditer(text)]


def run_command(command: str, cwd: Path) -> str:
    """`pipeblocks ...` run from `cwd`: its standard output. In this process, except
    `train`, whose ranks print to the terminal themselves."""
    if shlex.split(command)[1:2] == ["train"]:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "pipeblocks.cli.main", *shlex.split(command)[1:]], cwd=cwd,
                              env=env, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"`{command}` exited with {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout
    from pipeblocks.cli.main import main

    out = io.StringIO()
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
            code = main(shlex.split(command)[1:])
    finally:
        os.chdir(previous)
    if code != 0:
        raise RuntimeError(f"`{command}` exited with {code}: {err.getvalue().strip()}")
    return out.getvalue()


def run_python(source: str, cwd: Path) -> list[tuple[str, str, str]]:
    """(print line, shown output, real output) for each print followed by a `# output` line."""
    lines = source.splitlines()
    expected = [
        (line.strip(), lines[i + 1].strip()[2:])
        for i, line in enumerate(lines[:-1])
        if line.lstrip().startswith("print(") and lines[i + 1].lstrip().startswith("# ")
    ]
    if not expected:
        return []  # an illustration (a runtime under torchrun, a schedule sketch), not a doctest
    printed: list[str] = []

    def record(*args, **kwargs) -> None:
        buffer = io.StringIO()
        builtins.print(*args, **{**kwargs, "file": buffer})
        printed.append(buffer.getvalue().rstrip("\n"))

    previous = Path.cwd()
    os.chdir(cwd)
    try:
        exec(compile(source, "README.md", "exec"), {"print": record, "__name__": "readme"})
    finally:
        os.chdir(previous)
    calls = [line.strip() for line in lines if line.lstrip().startswith("print(")]
    by_line = dict(zip(calls, printed))
    return [(line, shown, by_line[line]) for line, shown in expected]


def _train_view(output: str) -> list[str]:
    """The lines of a train run that the seed fixes."""
    kept = []
    for line in output.splitlines():
        step = _STEP.match(line)
        if step:
            kept.append(f"step {step.group(1)}/{step.group(2)} loss {step.group(3)}")
        elif line.startswith(("training ", "schedule ", "eval ")) or re.match(r"^\s+\d+\s+[\d,]+\s", line):
            kept.append(" ".join(line.split()))
    return kept


def _train_block(output: str) -> str:
    """A train run as README shows it: the first step cut after its loss, then the last step."""
    lines = output.rstrip("\n").splitlines()
    steps = [i for i, line in enumerate(lines) if _STEP.match(line)]
    if len(steps) > 1:
        first = lines[steps[0]]
        cut = re.match(r"^(step\s+\S+\s+loss\s+\S+)", first).group(1)
        lines = lines[:steps[0]] + [cut + " ..."] + lines[steps[-1]:]
    return "\n".join(lines) + "\n"


def _same(block: Block, fresh: str) -> bool:
    if block.kind == "json":
        return json.loads(block.shown) == json.loads(fresh)
    if block.kind == "train":
        # the steps shown are among the run's; the other lines are those of the run cut as README cuts it
        # (`_train_block`: the eval lines between the first and the last step are left out, as those steps are)
        shown_steps = {line for line in _train_view(block.shown) if line.startswith("step")}
        cut = [x for x in _train_view(_train_block(fresh)) if not x.startswith("step")]
        return shown_steps <= set(_train_view(fresh)) and [
            x for x in _train_view(block.shown) if not x.startswith("step")] == cut
    return block.shown.rstrip("\n") == fresh.rstrip("\n")


def check(text: str, *, train: bool = False, write: bool = False, root: Path = ROOT) -> tuple[str, list[str]]:
    """(README text, with blocks rewritten when `write`; one message per block that differs)."""
    problems: list[str] = []
    pieces: list[str] = []
    cursor = 0
    for block in find_blocks(text):
        replacement = None
        with tempfile.TemporaryDirectory() as scratch:
            work = root if write else Path(scratch)
            if not write:
                (work / "docs" / "images").mkdir(parents=True)
                (work / "out").mkdir()
            if block.command and (block.kind != "train" or train):
                fresh = run_command(block.command, work)
                if not _same(block, fresh):
                    problems.append(f"`{block.command}`: README shows other output than the command prints")
                    if block.kind == "train":
                        fresh = _train_block(fresh)
                    replacement = f"$ {block.command}\n{fresh}"
            elif block.language == "python":
                for line, shown, real in run_python(block.body, Path(scratch)):
                    if shown != real:
                        problems.append(f"README's python block: {line} prints {real!r}, README shows {shown!r}")
                        replacement = (replacement or block.body).replace(f"{line}\n# {shown}", f"{line}\n# {real}")
        if write and replacement is not None and block.kind == "json":
            # README shows JSON compact, wrapped to the page (JSON ignores the line breaks)
            compact = json.dumps(json.loads(replacement.split("\n", 1)[1]))
            wrapped = textwrap.fill(compact, 92, subsequent_indent=" ", break_long_words=False, break_on_hyphens=False)
            replacement = f"$ {block.command}\n{wrapped}\n"
        pieces.append(text[cursor:block.start])
        pieces.append(replacement if (write and replacement is not None) else block.body)
        cursor = block.end
    pieces.append(text[cursor:])
    return "".join(pieces), problems


def check_schedule_table(text: str, root: Path = ROOT) -> list[str]:
    """One message per row of a schedule table whose figures are not `compare -p 4 -m 8`'s."""
    rows = _TABLE_ROW.findall(text)
    if not rows:
        return []
    printed = {}
    for line in run_command("pipeblocks compare -p 4 -m 8", root).splitlines():
        cells = line.split()
        if len(cells) >= 7 and re.fullmatch(r"[\d.]+", cells[3] or ""):
            printed[cells[0]] = (cells[6], cells[3], cells[4])  # vs 1F1B, bubble, span bub
    problems = []
    for name, memory, bubble, span in rows:
        if printed.get(name) != (memory, bubble, span):
            problems.append(f"schedule table: `{name}` shows {memory} {bubble} {span}, compare -p 4 -m 8 prints "
                            f"{printed.get(name)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=[str(ROOT / page) for page in PAGES],
                        help="pages to check (default: README.md and the docs pages in PAGES)")
    parser.add_argument("--write", action="store_true", help="rewrite the blocks that differ")
    parser.add_argument("--train", action="store_true", help="also run the train blocks (minutes, 2 processes each)")
    args = parser.parse_args(argv)
    failed = 0
    for name in args.files:
        path = Path(name)
        text, problems = check(path.read_text(), train=args.train, write=args.write)
        table = check_schedule_table(text)
        for problem in problems + table:
            print(f"{path.name}: {problem}")
        if args.write and problems:
            path.write_text(text)
            print(f"rewrote {len(problems)} block(s) in {path}")
        elif problems or table:
            failed += 1
        else:
            print(f"{path.name}: every checked output agrees with its command")
        failed += bool(args.write and table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
