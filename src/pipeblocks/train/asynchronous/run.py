"""`pipeblocks train --async MODE`: asynchronous pipeline training on local processes.

    >>> cfg, data = prepare(request, model=GPTConfig(), steps=20,
    ...                     async_mode=AsyncMode("pipemare", sync_warmup_steps=2))
    >>> train_async(cfg, data, report="run.json")   # loss per step, delays, steady state vs simulated
    >>> verify_async(cfg, data)                     # the same run against the one-process replay

A run of `cfg.steps` optimizer steps is its Programs (plan.py: the W synchronous warm-up
steps, then the schedule's asynchronous form, cut where the run drains; drain.py), each one
unit of the training loop (train/loop.py) with the asynchronous step strategy (steps.py):
one `PipelineRunner.step` per rank, whose OPTIMIZER_STEP ops the rank's `AsyncCompute`
takes. Step k trains on `TokenWindows.batch(k, m*b, seed)`, cut into m microbatches, as
synchronous training does.

Every rank measures the delay of every microbatch at its stages (the versions its
backward and its forward saw); `verify_async` checks them against the Programs' and
replays the run in one process (`reference.replay`, the specification) with the
same weights, data and delays, comparing every step's loss and every weight at the end.
`--report` (report.py) adds the measured steady state beside the simulator's.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ...core.lowering.async_mode import AsyncMode
from ...core.lowering.versions import WeightVersions
from ...models.build import build_model, split_stages
from ..config import TrainConfig
from ..describe import describe_loop
from ..loop import launch_reported
from ..prepare_checks import progress
from ..loop import train_rank as async_rank  # one rank of the run: the one loop, asynchronous steps for --async
from ..reference import TOLERANCE, relative_difference, torch_threads
from ..report import write_report
from .plan import nominal_delays, run_segments, run_versions
from .reference import replay
from .report import build_async_report, format_async_report
from .steps import AsyncRankResult, microbatches

__all__ = [
    "AsyncRankResult", "ReplayCheck", "async_rank", "check_against_replay",
    "replay_run", "steady_step_s", "train_async", "verify_async",
]

# `--verify` accepts what synchronous training's does (reference.TOLERANCE). The runtime and
# the replay run the same operations in the same order, and the replay runs with the ranks'
# number of torch threads, so on CPU they agree to the last bit (0 measured, float32 and
# float64). With other thread counts (or devices) float32 does not stay within 1e-5 over
# several steps: AdamW divides by the root of tiny second moments, so a rounding difference
# in a gradient near zero moves its weight by up to 2 lr (2.4e-4 relative measured over 8
# steps at p=4 with 1 thread against 2); float64 stays within 1e-12 there.


def steady_step_s(results: list[AsyncRankResult], warmup_steps: int) -> float | None:
    """The steady state's time per optimizer step: over every rank, the median time between
    two consecutive steps of its first stage, the first and last asynchronous step left out
    (fill and drain); None with fewer than 4 asynchronous steps."""
    gaps = []
    for r in results:
        times = r.step_times[warmup_steps:]
        gaps.extend(b - a for a, b in zip(times[1:-2], times[2:-1]))
    return statistics.median(gaps) if gaps else None


def describe_async(cfg: TrainConfig) -> str:
    s, mode = cfg.schedule, cfg.async_mode
    extra = ""
    if mode.name == "pipemare":
        extra = f" K={mode.k} D={mode.d:g}"
    elif mode.name == "nesterov":
        extra = f" D={mode.d:g}"
    return (f"asynchronous {s.name} ({mode.name}{extra}), p={s.p}, {s.m} microbatches per step, {cfg.steps} steps "
            f"({mode.sync_warmup_steps} synchronous), {cfg.model.describe()}, {cfg.precision.name}, microbatch "
            f"{cfg.microbatch_size}x{cfg.model.sequence} tokens")


def delay_lines(results: list[AsyncRankResult], w: int, n: int) -> list[str]:
    lines = ["stage  delays (min..max, asynchronous steps)"]
    for r in sorted(results, key=lambda r: r.rank):
        for s in r.stages:
            seen = r.delays[s][max(0, w - r.first_step) * n:]
            lines.append(f"{s:>5}  " + (f"{min(seen)}..{max(seen)}" if seen else "-"))
    return lines


def train_async(cfg: TrainConfig, data, *, report: str | None = None, plot: str | None = None) -> int:
    """Train asynchronously; print loss per step (as the run goes), delays per stage and
    throughput; with `report`, the measured steady state beside the simulator's (report.py)."""
    print(f"training {describe_async(cfg)} on {describe_loop(cfg, data)}", flush=True)
    results = launch_reported(cfg)
    if results is None:
        return 1
    built = build_async_report(cfg, results)
    print(format_async_report(built.data))
    for line in write_report(built, report, plot):
        print(line)
    return 0


@dataclass(frozen=True)
class ReplayCheck:
    """A run's results against the one-process replay: largest relative differences."""

    losses: float
    lrs: float
    weights: float
    worst_weight: tuple[int, str]
    """(stage, name) of the weight that differs most"""
    delays_equal: bool
    """whether every delay the ranks measured is the Program's"""
    num_weights: int
    tolerance: float

    @property
    def largest(self) -> float:
        return max(self.losses, self.lrs, self.weights)

    @property
    def ok(self) -> bool:
        return self.largest <= self.tolerance and self.delays_equal


def replay_run(cfg: TrainConfig, data):
    """The one-process replay of `cfg`'s run from step 0, with its drains at the save
    points: (ReplayResult, the trained stage modules). Without an asynchronous mode, the
    same run as synchronous training (every delay 0: a flush after every step)."""
    schedule, mode = cfg.schedule.schedule, cfg.async_mode
    if mode is None:  # any schedule: with every delay 0 each mode is synchronous training
        mode, nominal = AsyncMode("naive"), None
        versions = WeightVersions.synchronous(schedule.num_stages, schedule.m, cfg.steps)
    else:  # the replay runs the W synchronous steps itself, then these
        versions = run_versions(schedule, tuple(s for s in run_segments(cfg) if not s.synchronous), prefix=False)
        nominal = nominal_delays(schedule)
    xs, ys = microbatches(cfg, data, range(cfg.steps))
    spec = cfg.model.spec()
    whole = build_model(spec, seed=cfg.seed, dtype=getattr(torch, cfg.model.weights_dtype))
    stages = split_stages(spec, whole, schedule.num_stages, counts=cfg.stage_layers)
    factor = cfg.lr_schedule.factor if cfg.lr_schedule is not None else None
    # the ranks' thread count: matrix products then round as on the ranks
    with torch_threads(cfg.threads_for(schedule.p)):
        result = replay(stages, versions, list(zip(xs, ys)), loss_fn=spec.loss,
                        optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr), mode=mode,
                        nominal_delays=nominal, lr_factor=factor)
    return result, stages


def check_against_replay(cfg: TrainConfig, data, results: list[AsyncRankResult]) -> ReplayCheck:
    """Replay `cfg`'s run (from step 0, with its drains at the save points) in this process
    and compare the ranks' `results` with it."""
    versions = run_versions(cfg.schedule.schedule, run_segments(cfg))
    expected, stages = replay_run(cfg, data)
    losses = next(r.losses for r in results if r.losses)
    loss_diff = max(relative_difference(a, b) for a, b in zip(losses, expected.losses, strict=True))
    got = {key: t for r in results for key, t in r.params.items()}
    want = {(s, name): p.detach() for s, st in enumerate(stages) for name, p in st.named_parameters()}
    if got.keys() != want.keys():
        raise RuntimeError(f"the ranks returned weights {sorted(got)[:4]}..., the replay has {sorted(want)[:4]}...")
    worst_key, worst = max(((k, relative_difference(got[k], want[k])) for k in want), key=lambda kv: kv[1])
    lr_diff = max(relative_difference(a, b) for r in results for s in r.stages
                  for a, b in zip(r.lrs[s], (row[s] for row in expected.lrs), strict=True))
    delays_equal = all(r.delays[s] == versions.delays(s) for r in results for s in r.stages)
    return ReplayCheck(loss_diff, lr_diff, worst, worst_key, delays_equal, len(want),
                       TOLERANCE[cfg.precision.name])


def verify_async(cfg: TrainConfig, data) -> int:
    """The run on the ranks against the one-process replay; 0 within the tolerance of `--verify`."""
    progress(f"verify: {describe_async(cfg)}")
    results = launch_reported(cfg)
    if results is None:
        return 1
    check = check_against_replay(cfg, data, results)
    schedule, mode = cfg.schedule, cfg.async_mode
    print(f"verify asynchronous {schedule.name} {mode.name} p={schedule.p} m={schedule.m} steps={cfg.steps} "
          f"(W={mode.sync_warmup_steps}) {cfg.precision.name}: {cfg.steps} step losses vs the one-process replay, "
          f"largest relative difference {check.losses:.3g}; learning rates {check.lrs:.3g}; {check.num_weights} "
          f"weights after the run, largest relative difference {check.weights:.3g} "
          f"(stage {check.worst_weight[0]} {check.worst_weight[1]})")
    print("\n".join(delay_lines(results, mode.sync_warmup_steps, schedule.m)))
    print(f"delays measured on the ranks {'equal' if check.delays_equal else 'DIFFER FROM'} the Program's")
    print(f"largest relative difference {check.largest:.3g}, tolerance {check.tolerance:g}: "
          f"{'OK' if check.ok else 'FAILED'}")
    return 0 if check.ok else 1
