"""Stopping a run together: progress heartbeats, one agreed stop step, signals, orphans.

A rank reports progress and asks, after each step, whether the run is to stop:

    control = ctx.control                      # from spawn(...) or init_from_env(...)
    for step in range(start, steps):
        ...                                    # one pipeline step
        with control.critical():               # never interrupted half-way
            optimizer.step()
        if control.step_done(step + 1):        # True on every rank after the same step
            ...                                # save a checkpoint
            break

Under `spawn` each rank gets a `RankControl` on memory shared with its launcher:

* `step_done` (and `beat`) stamp the rank's heartbeat; the launcher stops a rank that
  stamps none for `timeout_s` (a step, receive or collective that makes no progress).
* A stop request (SIGTERM, SIGINT or SIGHUP to the launcher or to a rank, or the launcher
  dying) becomes one stop step, the step after the newest one any rank has completed:
  no rank is further than that step, so every rank reaches it and stops there, and
  checkpoints saved on the way out are of one step.
* SIGUSR1 from the launcher (it gave up waiting: a rank failed, timed out, or did not reach
  the stop step in time) raises `Interrupted` in the rank's main thread, outside
  `critical()` sections, so it can still save its last completed step.
* The rank dies with its launcher: Linux delivers SIGTERM to it when the launcher dies
  (prctl PR_SET_PDEATHSIG), and a watchdog thread that polls the parent pid (any POSIX
  system) asks for a stop and, if the rank has not exited `ORPHAN_GRACE_S` later, ends it.

Under torchrun, `init_from_env(stop_signals=True)` gives a `SignalControl`: SIGTERM,
SIGINT and SIGHUP set a flag, and `step_done` agrees on it over the process group (one
small all-reduce per step), so torchrun's SIGTERM to every worker ends the run after one
common step.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "ORPHAN_GRACE_S", "STOP_SIGNALS", "Interrupted", "RankControl", "RunControl", "RunState", "SignalControl",
    "signal_name",
]

STOP_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name)
)
"""Signals that ask a run to stop after its next common step (and save, when it saves)."""
INTERRUPT_SIGNAL = getattr(signal, "SIGUSR1", None)
"""What the launcher sends to stop a rank where it is."""
ORPHAN_GRACE_S = 5.0
"""A rank whose launcher died has this long to stop at the agreed step before it ends itself."""
WATCH_INTERVAL_S = 0.1
LAUNCHER_GONE = -1
"""Stands for the signal in a stop request made because the launcher died."""
_NO_STOP = -1


class Interrupted(BaseException):
    """Raised in a rank's main thread when its launcher stops it where it is.

    A BaseException, like KeyboardInterrupt, so that `except Exception` in user code does
    not swallow it.
    """


def signal_name(signum: int) -> str:
    if signum == LAUNCHER_GONE:
        return "the launcher's death"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class RunState:
    """Memory that a launcher shares with its ranks (created before they start).

    beats[r]: time.monotonic() of rank r's last progress (0: none yet; the monotonic
    clock is machine-wide). done[r]: steps rank r has completed. stop: [the agreed stop
    step or -1, the signal that asked for it (0: none), who asked: a rank, or -1 for
    the launcher].
    """

    beats: Any
    done: Any
    stop: Any
    lock: Any

    @classmethod
    def create(cls, mp_context, nprocs: int) -> RunState:
        stop = mp_context.RawArray("q", 3)
        stop[0] = _NO_STOP
        return cls(mp_context.RawArray("d", nprocs), mp_context.RawArray("q", nprocs), stop, mp_context.Lock())

    @property
    def stop_signal(self) -> int:
        return int(self.stop[1])

    @property
    def stop_requester(self) -> int:
        return int(self.stop[2])

    @property
    def stop_step(self) -> int | None:
        return None if self.stop[0] == _NO_STOP else int(self.stop[0])

    def ask_stop(self, signum: int, requester: int) -> None:
        """Record a stop request without the lock (the launcher's side: a launcher killed
        while holding the lock would leave its ranks waiting on it); the next rank that
        passes a step turns it into the stop step."""
        if self.stop[1] == 0:
            self.stop[2] = requester
            self.stop[1] = signum

    def _settle_stop(self) -> None:
        # caller holds the lock
        if self.stop[0] == _NO_STOP and self.stop[1] != 0:
            self.stop[0] = max(self.done) + 1


class RunControl:
    """A rank's link to whatever may stop its run. This base never stops (a process group
    started by other means, and nothing to watch)."""

    def beat(self) -> None:
        """Report progress that is not a completed step (setup, a checkpoint written)."""

    def step_done(self, done: int) -> bool:
        """Report that `done` steps are complete; True: stop now (every rank gets True
        after the same step)."""
        return False

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """A section that an interrupt must not cut in half (an optimizer step, a save)."""
        yield

    @property
    def stop_reason(self) -> str | None:
        """Why the run stops ("SIGTERM to the launcher (pid N)"), once it does; else None."""
        return None


class RankControl(RunControl):
    """One rank's side of `RunState`, for ranks started by `launch.spawn`."""

    def __init__(self, state: RunState, rank: int, launcher_pid: int) -> None:
        self._state = state
        self.rank = rank
        self._launcher = launcher_pid
        self._parent = os.getppid()  # the launcher, or a fork server that dies with it
        self._signal = 0  # set by a handler; acted on outside it (a handler must not take the lock)
        self._critical = 0
        self._interrupt_pending = False
        self._disarmed = False
        self.orphaned = False

    def start(self) -> None:
        """Install the signal handlers, the parent-death signal and the watchdog (main thread)."""
        _die_with_parent(signal.SIGTERM)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_stop_signal)
        if INTERRUPT_SIGNAL is not None:
            signal.signal(INTERRUPT_SIGNAL, self._on_interrupt)
        threading.Thread(target=self._watch, name=f"pipeblocks-watchdog-{self.rank}", daemon=True).start()

    def finish(self) -> None:
        """The rank's work is over (result reported): interrupts no longer apply."""
        self._disarmed = True

    def beat(self) -> None:
        self._state.beats[self.rank] = time.monotonic()

    def step_done(self, done: int) -> bool:
        state = self._state
        with state.lock:
            state.beats[self.rank] = time.monotonic()
            state.done[self.rank] = done
            if self._signal:
                state.ask_stop(self._signal, self.rank)
            state._settle_stop()
            stop = state.stop[0]
        return stop != _NO_STOP and done >= stop

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        self._critical += 1
        try:
            yield
        finally:
            self._critical -= 1
        if not self._critical and self._interrupt_pending:
            self._interrupt_pending = False
            self._raise_interrupt()

    @property
    def stop_reason(self) -> str | None:
        signum = self._state.stop_signal
        if not signum:
            return None
        who = self._state.stop_requester
        return f"{signal_name(signum)} to " + ("the launcher" if who < 0 else f"rank {who}")

    # ---- handlers and the watchdog ---------------------------------------------------
    def _on_stop_signal(self, signum: int, _frame) -> None:
        if not self._signal:
            self._signal = signum

    def _on_interrupt(self, _signum: int, _frame) -> None:
        if self._disarmed:
            return
        if self._critical:
            self._interrupt_pending = True
            return
        self._raise_interrupt()

    def _raise_interrupt(self) -> None:
        self._disarmed = True  # once: the rank may now save on its way out
        raise Interrupted(f"rank {self.rank} was stopped by its launcher")

    def _launcher_gone(self) -> bool:
        # a dead parent re-parents this process at once; the pid check covers a launcher
        # that died before this process started watching
        if os.getppid() != self._parent:
            return True
        try:
            os.kill(self._launcher, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # exists, under another user
            pass
        return False

    def _watch(self) -> None:
        orphaned_at = None
        while True:
            time.sleep(WATCH_INTERVAL_S)
            if self._signal and not self._state.stop_signal:
                with self._state.lock:
                    self._state.ask_stop(self._signal, self.rank)
                    self._state._settle_stop()
            if not self._launcher_gone():
                continue
            now = time.monotonic()
            if orphaned_at is None:
                orphaned_at, self.orphaned = now, True
                with self._state.lock:
                    self._state.ask_stop(LAUNCHER_GONE, self.rank)
                    self._state._settle_stop()
            elif now - orphaned_at > ORPHAN_GRACE_S:
                print(f"pipeblocks: rank {self.rank}: launcher {self._launcher} is gone and the rank did not stop "
                      f"within {ORPHAN_GRACE_S:g} s; ending it", file=sys.stderr, flush=True)
                os._exit(1)


class SignalControl(RunControl):
    """Stop on SIGTERM/SIGINT/SIGHUP, agreed over a process group after each step (torchrun)."""

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self._device = device
        self._group = group
        self._signal = 0
        self._agreed = 0
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        if not self._signal:
            self._signal = signum

    def step_done(self, done: int) -> bool:
        flag = torch.tensor([self._signal], dtype=torch.int64, device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        self._agreed = int(flag.item())
        return self._agreed != 0

    @property
    def stop_reason(self) -> str | None:
        return f"{signal_name(self._agreed)} to a rank" if self._agreed else None


def _die_with_parent(signum: int) -> None:
    """Linux: have the kernel send `signum` to this process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signum), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the watchdog thread still covers it
        pass
