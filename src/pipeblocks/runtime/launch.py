"""Starting the pipeline processes: a local spawn helper and the `torchrun` path.

Local (one machine, N processes)::

    from pipeblocks.runtime.launch import spawn

    def train(ctx, schedule_name):          # a top-level function: it is pickled
        ...                                  # build stages for ctx.rank, PipelineRunner, steps
        return final_loss                    # any picklable value

    results = spawn(train, 4, args=("1f1b",), timeout_s=600)   # one result per rank

`spawn` picks gloo on CPU and NCCL when CUDA is there (rank r on cuda:r mod the device
count), starts the processes, and watches them: the first rank that raises stops every
rank at once and `spawn` raises `RankFailedError` with that rank's traceback; a rank that
dies without a word, or a run past `timeout_s`, stops them too. Nothing is left hanging.

Under torchrun (`torchrun --nproc-per-node 4 train.py`), call `init_from_env()` in the
script: it reads RANK, WORLD_SIZE and LOCAL_RANK, initialises the process group and
returns the same `DistContext`; torchrun stops the other ranks when one fails.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..core.schedule import Schedule

__all__ = ["DistContext", "RankFailedError", "check_world", "default_device", "init_from_env", "spawn"]


class RankFailedError(RuntimeError):
    """One rank raised (or died); `rank` is the first that failed, `remote_traceback` its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        super().__init__(message + (f"\n--- traceback of rank {rank} ---\n{remote_traceback}" if remote_traceback else ""))
        self.rank = rank
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job.

    rank, world_size: in the default process group.  local_rank: on this machine.
    device: where its stages live.  backend: "gloo" or "nccl".
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def default_device(local_rank: int) -> torch.device:
    """cuda:(local_rank mod device count) when CUDA is there, else CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def check_world(schedule: Schedule, world_size: int) -> None:
    """Raise ValueError unless the schedule fits `world_size` processes."""
    if world_size != schedule.p:
        raise ValueError(
            f"schedule {schedule.name!r} needs p={schedule.p} processes but {world_size} would be launched: "
            f"launch {schedule.p}, or build the schedule with p={world_size}"
        )


def init_from_env(*, timeout_s: float = 300.0, backend: str | None = None) -> DistContext:
    """Initialise the default process group from torchrun's environment (env:// rendezvous)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"environment lacks {missing}: run under torchrun, or use pipeblocks.runtime.launch.spawn")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return _init(rank, world, local_rank, timeout_s, backend)


def _init(rank: int, world: int, local_rank: int, timeout_s: float, backend: str | None) -> DistContext:
    device = default_device(local_rank)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s), init_method="env://"
        )
    return DistContext(rank, world, local_rank, device, backend)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    *,
    args: Sequence[Any] = (),
    timeout_s: float = 600.0,
    backend: str | None = None,
    threads_per_rank: int | None = None,
    schedule: Schedule | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Run `fn(ctx, *args)` in `nprocs` local processes; return their results by rank.

    schedule: if given, checked against `nprocs` before anything starts.
    threads_per_rank: `torch.set_num_threads` in each process (None: torch's default).
    Raises RankFailedError (first failing rank) or TimeoutError (the whole run past timeout_s).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if schedule is not None:
        check_world(schedule, nprocs)
    ctx = mp.get_context(start_method)
    results_queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, nprocs, port, backend, timeout_s, threads_per_rank, fn, tuple(args), results_queue),
            daemon=True,
        )
        for rank in range(nprocs)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    dead_since: dict[int, float] = {}
    try:
        while len(results) < nprocs:
            try:
                status, rank, payload, tb = results_queue.get(timeout=0.05)
            except queue_mod.Empty:
                now = time.monotonic()
                for rank, proc in enumerate(procs):
                    if rank not in results and proc.exitcode is not None:
                        # give its queue message a moment to arrive before calling it silent
                        if now - dead_since.setdefault(rank, now) > 2.0:
                            raise RankFailedError(
                                rank, f"rank {rank} exited with code {proc.exitcode} without reporting a result "
                                "(killed, out of memory, or os._exit)"
                            )
                if now > deadline:
                    raise TimeoutError(
                        f"spawn: {nprocs - len(results)} rank(s) {sorted(set(range(nprocs)) - set(results))} did not "
                        f"finish within timeout_s={timeout_s:g}; all ranks were stopped"
                    )
                continue
            if status == "error":
                raise RankFailedError(rank, f"rank {rank} failed: {payload}", tb)
            results[rank] = pickle.loads(payload)
    finally:
        _stop(procs)
    return [results[r] for r in range(nprocs)]


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    limit = time.monotonic() + 3.0
    for proc in procs:
        proc.join(max(0.0, limit - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank, world, port, backend, timeout_s, threads, fn, args, results_queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        ctx = _init(rank, world, rank, timeout_s, backend)
        # pickled here, by value: torch's queue reductions would pass tensors through
        # shared memory that dies with this process
        result = pickle.dumps(fn(ctx, *args))
        results_queue.put(("ok", rank, result, ""))
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the parent
        results_queue.put(("error", rank, f"{type(err).__name__}: {err}", traceback.format_exc()))
        return
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown after a reported result
        pass
