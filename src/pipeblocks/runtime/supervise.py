"""The launcher's side of a local run: collect results, watch heartbeats, stop, and blame.

`supervise` runs in the process that called `launch.spawn` while its ranks work:

* Results and errors arrive on a queue; exits are polled. When something fails it waits
  `SETTLE_S` for the other ranks' exit statuses, then blames the rank that failed first:
  a rank that died without a word (killed by a signal, or a non-zero exit) is the cause
  of the errors its peers report next ("Connection reset by peer"), so it is named first,
  with its pid and signal, and the first peer error after it.
* A rank whose heartbeat (`RankControl.step_done` / `beat`) is older than `timeout_s` is
  stuck; before its first one (process start, rendezvous, building its model) it has
  max(timeout_s, `STARTUP_S`).
* SIGTERM, SIGINT or SIGHUP to the launcher asks the ranks to stop after their next
  common step (see lifecycle.py); they get `STOP_GRACE_S` for it, a second signal cuts
  that short. Then, as after any failure, the ranks still running get SIGUSR1 (they stop
  where they are, saving their last completed step when they save), and SIGKILL
  `INTERRUPT_GRACE_S` later. No rank outlives `spawn`.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_mod
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from .lifecycle import INTERRUPT_SIGNAL, STOP_SIGNALS, RunState, signal_name

__all__ = [
    "INTERRUPT_GRACE_S",
    "SETTLE_S",
    "STARTUP_S",
    "STOP_GRACE_S",
    "RankFailedError",
    "RunStoppedError",
    "catch_stop_signals",
    "stop_all",
    "supervise",
]

STARTUP_S = 60.0
"""Until its first progress report a rank may take this long even when timeout_s is shorter."""
STOP_GRACE_S = 5.0
"""After a stop request, ranks have this long to reach the agreed step (and save) before being interrupted."""
INTERRUPT_GRACE_S = 3.0
"""After SIGUSR1, ranks have this long to save their last completed step and exit before SIGKILL."""
SETTLE_S = 0.5
"""After the first failure, how long to wait for the other ranks' exit statuses before blaming one."""
SILENT_EXIT_S = 2.0
"""A rank that exited with status 0 without a result may still have a message in flight this long."""
POLL_S = 0.05


class RankFailedError(RuntimeError):
    """One rank raised (or died); `rank` is the first that failed, `remote_traceback` its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        tail = f"\n--- traceback of rank {rank} ---\n{remote_traceback}" if remote_traceback else ""
        super().__init__(message + tail)
        self.rank = rank
        self.remote_traceback = remote_traceback


class RunStoppedError(RuntimeError):
    """The run was asked to stop by a signal. `signal`: its number; `results`: rank -> result
    of the ranks that returned (they stopped at the agreed step); `stop_step`: that step
    (None if no rank reached a step boundary)."""

    def __init__(self, message: str, signum: int, results: dict[int, Any], stop_step: int | None) -> None:
        super().__init__(message)
        self.signal = signum
        self.results = results
        self.stop_step = stop_step


@contextlib.contextmanager
def catch_stop_signals(received: list[int]) -> Iterator[None]:
    """Append each stop signal's number to `received` instead of dying (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def supervise(procs: list, results_queue, state: RunState, timeout_s: float, received: list[int]) -> list[Any]:
    """Wait for every rank's result; raise RankFailedError, TimeoutError or RunStoppedError."""
    nprocs = len(procs)
    started = time.monotonic()
    results: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}  # in order of arrival
    exits: dict[int, tuple[int, float]] = {}  # rank -> (exit code, when first seen)
    stopping_since: float | None = None
    while True:
        _collect(results_queue, results, errors, POLL_S)
        now = time.monotonic()
        _poll_exits(procs, exits, now)
        if received and not state.stop_signal:
            state.ask_stop(received[0], -1)
        if state.stop_signal and stopping_since is None:
            stopping_since = now
        if len(results) == nprocs:
            if stopping_since is not None:
                raise _stopped(state, procs, results, [], "")
            return [results[r] for r in range(nprocs)]
        silent = [r for r, (code, seen) in exits.items()
                  if r not in results and r not in errors and (code != 0 or now - seen > SILENT_EXIT_S)]
        if errors or silent:
            _settle(procs, results_queue, results, errors, exits)
            raise _blame(procs, results, errors, exits)
        if stopping_since is not None:
            if len(received) > 1 or now - stopping_since > STOP_GRACE_S:
                late = [r for r in range(nprocs) if r not in results]
                why = "a second signal" if len(received) > 1 else f"not reached within {STOP_GRACE_S:g} s"
                raise _stopped(state, procs, results, late, why)
            continue
        for rank in range(nprocs):
            if rank in results or rank in exits:
                continue
            beat = state.beats[rank]
            if beat == 0.0 and now - started > max(timeout_s, STARTUP_S):
                raise TimeoutError(
                    f"rank {rank} reported no progress within {max(timeout_s, STARTUP_S):g} s of its start "
                    "(process start-up, rendezvous, building its model, or a function that never reports and "
                    "runs that long): every rank was stopped"
                )
            if beat and now - beat > timeout_s:
                done = state.done[rank]
                at = f"after step {done}" if done else "before completing a step"
                raise TimeoutError(
                    f"rank {rank} made no progress for {timeout_s:g} s ({at}): a step, receive or collective "
                    "that does not finish; every rank was stopped (raise the timeout if one step really takes "
                    "that long)"
                )


def stop_all(procs: list, results_queue, *, interrupt: bool) -> None:
    """End every rank still running: SIGUSR1 if `interrupt`, then SIGKILL after INTERRUPT_GRACE_S."""
    if interrupt and INTERRUPT_SIGNAL is not None:
        for proc in procs:
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, INTERRUPT_SIGNAL)
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
        # keep the pipe drained: a rank exits only once its queued messages are written
        _collect(results_queue, {}, {}, POLL_S)
    for proc in procs:
        if proc.pid is None:
            continue  # never started (its start failed): nothing to end, and join() would raise
        if proc.is_alive():
            proc.kill()
        proc.join(1.0)


# ---- helpers --------------------------------------------------------------------------
def _collect(results_queue, results: dict, errors: dict, wait_s: float) -> None:
    try:
        message = results_queue.get(timeout=wait_s)
    except queue_mod.Empty:
        return
    while True:
        status, rank, payload, tb = message
        if status == "error":
            errors.setdefault(rank, (payload, tb))
        else:
            results[rank] = pickle.loads(payload)
        try:
            message = results_queue.get_nowait()
        except queue_mod.Empty:
            return


def _poll_exits(procs: list, exits: dict, now: float) -> None:
    for rank, proc in enumerate(procs):
        if rank not in exits and proc.exitcode is not None:
            exits[rank] = (proc.exitcode, now)


def _settle(procs, results_queue, results, errors, exits) -> None:
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        _collect(results_queue, results, errors, POLL_S)
        _poll_exits(procs, exits, time.monotonic())


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    return f"exited with code {code} without reporting a result (out of memory, os._exit, or a native crash)"


def _blame(procs, results, errors, exits) -> RankFailedError:
    silent = [(seen, rank, code) for rank, (code, seen) in exits.items() if rank not in results and rank not in errors]
    # a rank killed by a signal or a non-zero exit comes before one that merely ended
    dead = sorted((seen, rank) for seen, rank, code in silent if code != 0) or sorted((s, r) for s, r, _ in silent)
    if dead:
        rank = dead[0][1]
        message = f"rank {rank} (pid {procs[rank].pid}) {_describe_exit(exits[rank][0])}"
        others = [r for _, r in dead[1:]]
        if others:
            message += f"; ranks {others} died too"
        if errors:
            follower, (text, _tb) = next(iter(errors.items()))
            message += f"; rank {follower} then failed: {text}"
        return RankFailedError(rank, message)
    rank, (text, tb) = next(iter(errors.items()))
    return RankFailedError(rank, f"rank {rank} failed: {text}", tb)


def _stopped(state: RunState, procs, results: dict, late: list[int], why: str) -> RunStoppedError:
    signum, who = state.stop_signal, state.stop_requester
    asker = f"the launcher (pid {os.getpid()})" if who < 0 else f"rank {who} (pid {procs[who].pid})"
    step = state.stop_step
    message = f"stopped by {signal_name(signum)} to {asker}: "
    if late:
        message += f"ranks {late} were interrupted before the common stop step ({why})"
    else:
        message += f"every rank stopped after step {step}" if step is not None else "every rank stopped"
    return RunStoppedError(message, signum, dict(results), step)
