"""Finding a process tree through /proc (Linux), for the tests that stop runs: every live
descendant of a launcher with its start time, so that a reused pid is not mistaken for it."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["alive", "cmdline", "descendants", "kill_all", "stat", "survivors"]


def stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    # the command name (field 2) is in parentheses and may hold spaces
    return [text[:text.index(" ")], text[text.index("(") + 1:text.rindex(")")], *text[text.rindex(")") + 2:].split()]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every live descendant of `root`."""
    children: dict[int, list[int]] = {}
    starts: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = stat(int(entry.name))
        except (OSError, ValueError):
            continue
        if fields[2] != "Z":
            children.setdefault(int(fields[3]), []).append(int(entry.name))
            starts[int(entry.name)] = fields[21]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def alive(pid: int, start: str) -> bool:
    """Running (not a zombie) and the same process (not a reused pid)."""
    try:
        fields = stat(pid)
    except (OSError, ValueError):
        return False
    return fields[2] != "Z" and fields[21] == start


def survivors(processes: dict[int, str], limit_s: float) -> list[str]:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if not any(alive(pid, start) for pid, start in processes.items()):
            return []
        time.sleep(0.1)
    return [f"{pid}: {cmdline(pid)[:120]}" for pid, start in processes.items() if alive(pid, start)]


def kill_all(processes: dict[int, str]) -> None:
    """SIGKILL every one of `processes` that is still the same live process."""
    for pid, start in processes.items():
        if alive(pid, start):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
