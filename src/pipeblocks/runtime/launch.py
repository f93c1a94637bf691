"""Starting the pipeline processes: a local spawn helper and the `torchrun` path.

Local (one machine, N processes)::

    from pipeblocks.runtime.launch import spawn

    def train(ctx, schedule_name):          # a top-level function: it is pickled
        ...                                  # build stages for ctx.rank, PipelineRunner, steps
        return final_loss                    # any picklable value

    results = spawn(train, 4, args=("1f1b",), timeout_s=600)   # one result per rank

`spawn` picks gloo on CPU and NCCL on CUDA (`device=`: "auto", "cpu" or "cuda"; rank r on
cuda:r), starts the processes, and watches them (supervise.py): the first rank that raises
stops every rank at once and `spawn` raises `RankFailedError` with that rank's traceback; a
rank that dies without a word is named with its signal or exit status, before the peers
that failed after it. `timeout_s` bounds a wait that makes no progress, never a run that
does: a rank that reports no progress (`ctx.control.step_done` / `ctx.control.beat`) for
timeout_s is stopped. SIGTERM, SIGINT or SIGHUP stops every rank after one common step
(see lifecycle.py) and raises `RunStoppedError`; ranks die with their launcher. Nothing is
left hanging or running.

Under torchrun (`torchrun --nproc-per-node 4 train.py`), `run_here(fn, args=...)` runs
`fn(ctx, *args)` in this process as its rank and gathers every rank's result to rank 0
(`under_torchrun()` tells whether torchrun started this process); or call `init_from_env()` in the
script: it reads RANK, WORLD_SIZE and LOCAL_RANK, initialises the process group and
returns the same `DistContext`; torchrun stops the other ranks when one fails. With
`stop_signals=True`, `ctx.control.step_done(k)` turns torchrun's SIGTERM into a stop after
one common step.
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..core.ir.schedule import Schedule
from .lifecycle import RankControl, RunControl, RunState, SignalControl
from .supervise import STARTUP_S, RankFailedError, RunStoppedError, catch_stop_signals, stop_all, supervise

__all__ = [
    "DEVICES", "DistContext", "RankFailedError", "RunStoppedError", "check_world", "choose_device", "default_device",
    "init_from_env", "run_here", "spawn", "under_torchrun",
]

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job.

    rank, world_size: in the default process group.  local_rank: on this machine.
    device: where its stages live.  backend: "gloo" or "nccl".
    control: progress and stop requests (lifecycle.py): call `control.step_done(k)` after
        each step and stop when it returns True.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    control: RunControl = field(default_factory=RunControl, compare=False, repr=False)


def choose_device(requested: str, local_ranks: int, *, note=None) -> str:
    """The device type ("cpu" or "cuda") for `local_ranks` processes on this machine.

    "cuda" needs a GPU per local rank (NCCL cannot put two ranks on one GPU): with fewer,
    ValueError in one line naming both counts and the fixes, before anything is launched.
    "auto" takes CUDA when there is a GPU for every local rank, else the CPU, and then says
    why through `note(message)` when CUDA is there but too small.
    """
    if requested not in DEVICES:
        raise ValueError(f"--device {requested!r}: choose one of {', '.join(DEVICES)}")
    if requested == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda":
        if gpus == 0:
            raise ValueError("--device cuda: CUDA is not available here (torch.cuda.is_available() is False): "
                             "use --device cpu, or a machine with a GPU and a CUDA build of torch")
        if local_ranks > gpus:
            raise ValueError(
                f"--device cuda: {local_ranks} ranks on this machine but {gpus} GPU{'s' if gpus != 1 else ''} "
                f"visible, and NCCL cannot put two ranks on one GPU: use --device cpu, fewer ranks "
                f"(p x dp <= {gpus}), or torchrun over more GPUs (nodes)"
            )
        return "cuda"
    if gpus >= local_ranks:
        return "cuda"
    if gpus and note is not None:
        note(f"device auto: {local_ranks} ranks but {gpus} GPU{'s' if gpus != 1 else ''} visible: running on the CPU "
             "(gloo); use fewer ranks, or torchrun over more GPUs, to train on CUDA")
    return "cpu"


def default_device(local_rank: int, kind: str = "auto") -> torch.device:
    """This rank's device: cuda:local_rank for "cuda" (and for "auto" when CUDA is there),
    else the CPU."""
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available() and torch.cuda.device_count() > 0):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def check_world(schedule: Schedule, world_size: int) -> None:
    """Raise ValueError unless the schedule fits `world_size` processes."""
    if world_size != schedule.p:
        raise ValueError(
            f"schedule {schedule.name!r} needs p={schedule.p} processes but {world_size} would be launched: "
            f"launch {schedule.p}, or build the schedule with p={world_size}"
        )


def init_from_env(
    *, timeout_s: float = 300.0, backend: str | None = None, stop_signals: bool = False, device: str = "auto",
) -> DistContext:
    """Initialise the default process group from torchrun's environment (env:// rendezvous).

    stop_signals: SIGTERM, SIGINT and SIGHUP no longer end the process; they make
    `ctx.control.step_done(k)` return True on every rank after the same step (one small
    all-reduce per call), so the script can save and exit cleanly.
    device: "auto", "cpu" or "cuda" (`choose_device`, with LOCAL_WORLD_SIZE ranks on this node).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"environment lacks {missing}: run under torchrun, or use pipeblocks.runtime.launch.spawn")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    kind = choose_device(device, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    ctx = _init(rank, world, local_rank, timeout_s, backend, device=kind)
    if stop_signals:
        ctx = DistContext(ctx.rank, ctx.world_size, ctx.local_rank, ctx.device, ctx.backend, SignalControl(ctx.device))
    return ctx


def _init(
    rank: int, world: int, local_rank: int, timeout_s: float, backend: str | None, control: RunControl | None = None,
    store: dist.Store | None = None, device: str = "auto",
) -> DistContext:
    device = default_device(local_rank, device)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        # the rank's device, so that NCCL need not guess it ("Guessing device ID")
        where = {"device_id": device} if device.type == "cuda" else {}
        if store is None:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, init_method="env://", **where)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, store=store, **where)
    return DistContext(rank, world, local_rank, device, backend, control or RunControl())


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
    device: str = "auto",
) -> list[Any]:
    """Run `fn(ctx, *args)` in `nprocs` local processes; return their results by rank.

    timeout_s: the longest time between two progress reports of a rank
        (`ctx.control.step_done` or `.beat`). Before its first report a rank has
        max(timeout_s, STARTUP_S = 60 s) to start, meet the others and build its model (a
        function that reports nothing has that for its whole run); that is also the
        process group's timeout for collectives. PipelineRunner's receives have their own
        `timeout_s`.
    schedule: if given, checked against `nprocs` before anything starts.
    threads_per_rank: `torch.set_num_threads` in each process (None: torch's default).
    device: "auto", "cpu" or "cuda", checked against the GPUs here before anything starts
        (`choose_device`).
    Raises RankFailedError (the rank that failed first), TimeoutError (a rank made no
    progress), or RunStoppedError (SIGTERM, SIGINT or SIGHUP to this process or a rank).
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    if schedule is not None:
        check_world(schedule, nprocs)
    kind = choose_device(device, nprocs, note=lambda message: print(message, file=sys.stderr, flush=True))
    ctx = mp.get_context(start_method)
    results_queue = ctx.Queue()
    state = RunState.create(ctx, nprocs)
    # The launcher holds the rendezvous store for the whole run: a port chosen here and
    # listened on later by rank 0 could be taken by another process in between.
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_S)),
    )
    port = store.port
    procs = [
        ctx.Process(
            target=_child,
            args=(rank, nprocs, port, backend, timeout_s, threads_per_rank, fn, tuple(args), results_queue, state,
                  os.getpid(), kind),
            daemon=True,
        )
        for rank in range(nprocs)
    ]
    received: list[int] = []
    finished = False
    with catch_stop_signals(received):
        try:
            for proc in procs:
                proc.start()
            results = supervise(procs, results_queue, state, timeout_s, received)
            finished = True
        finally:
            stop_all(procs, results_queue, interrupt=not finished)
    return results


def _child(rank, world, port, backend, timeout_s, threads, fn, args, results_queue, state, launcher_pid, kind) -> None:
    control = RankControl(state, rank, launcher_pid)
    control.start()
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        # rendezvous waits for the slowest process to start, which is not a stuck wait
        startup = max(timeout_s, STARTUP_S)
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=startup)
        )
        ctx = _init(rank, world, rank, startup, backend, control, store=store, device=kind)
        # pickled here, by value: torch's queue reductions would pass tensors through
        # shared memory that dies with this process
        result = pickle.dumps(fn(ctx, *args))
        message = ("ok", rank, result, "")
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the parent
        message = ("error", rank, f"{type(err).__name__}: {err}", traceback.format_exc())
    control.finish()
    if not control.orphaned:  # else nobody reads the queue: a large result would block the exit forever
        results_queue.put(message)
        results_queue.close()
        results_queue.join_thread()
    if message[0] == "ok":
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a reported result
            pass
    # The message is written; the interpreter's own teardown with torch loaded takes
    # seconds and serves nobody.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another env:// launcher that sets
    RANK, WORLD_SIZE and LOCAL_RANK)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def run_here(
    fn: Callable[..., Any], *, args: Sequence[Any] = (), world_size: int | None = None, timeout_s: float = 300.0,
    device: str = "auto", threads_per_rank: int | None = None,
) -> list[Any] | None:
    """Run `fn(ctx, *args)` as this process's rank of a torchrun job; return every rank's
    result by rank on rank 0, None on the others.

    world_size: the number of processes the job needs, checked against torchrun's WORLD_SIZE
    before the process group starts (a ValueError names both and the fix). SIGTERM, SIGINT
    and SIGHUP (torchrun sends SIGTERM to every worker when it is stopped) end the run after
    one common step (`ctx.control`). A rank that raises ends this process with the error;
    torchrun then stops the others.
    """
    if not under_torchrun():
        raise ValueError("run_here needs torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK): use spawn instead")
    world = int(os.environ["WORLD_SIZE"])
    if world_size is not None and world != world_size:
        raise ValueError(
            f"the run needs {world_size} processes but torchrun started {world} (WORLD_SIZE): give torchrun "
            f"--nnodes x --nproc-per-node = {world_size}, or change -p/--dp so that their product is {world}"
        )
    if threads_per_rank is not None:
        torch.set_num_threads(threads_per_rank)
    ctx = init_from_env(timeout_s=timeout_s, stop_signals=True, device=device)
    result = fn(ctx, *args)
    gathered: list[Any] | None = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    dist.destroy_process_group()
    return gathered
