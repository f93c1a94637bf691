"""`pipeblocks train --async MODE`: asynchronous pipeline training on local processes.

    >>> cfg, data = prepare(request, model=GPTConfig(), steps=20,
    ...                     async_mode=AsyncMode("pipemare", sync_warmup_steps=2))
    >>> train_async(cfg, data)        # loss per optimizer step, delays per stage, tokens/s
    >>> verify_async(cfg, data)       # the same run against the one-process replay

A run of `cfg.steps` optimizer steps of m microbatches each is the mode's W synchronous
warm-up steps (one-step Programs: a flush after each), then the schedule's asynchronous
form (`pipeblocks.schedules.asynchronous.ASYNC_FORMS`) over the remaining steps: one
Program, run by one `PipelineRunner.step` per rank, whose OPTIMIZER_STEP ops the rank's
`AsyncCompute` takes. Step k trains on `TokenWindows.batch(k, m*b, seed)`, cut into m
microbatches, as synchronous training does.

Every rank measures the delay of every microbatch at its stages (the versions its
backward and its forward saw); `verify_async` checks them against the Program's and
replays the run in one process (`reference.replay`, the specification) with the
same weights, data and delays, comparing every step's loss and every weight at the end.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

from ...core.program import Program
from ...core.request import ScheduleRequest
from ...core.schedule import Schedule
from ...core.versions import WeightVersions, weight_versions
from ...schedules.asynchronous import ASYNC_FORMS
from ...core.async_mode import AsyncMode
from ..config import TrainConfig

__all__ = [
    "AsyncRankResult", "ReplayCheck", "async_rank", "check_against_replay", "check_async",
    "launch_async", "run_plan", "steady_step_s", "train_async", "verify_async",
]

# `--verify` accepts what synchronous training's does (reference.TOLERANCE). The runtime and
# the replay run the same operations in the same order, and the replay runs with the ranks'
# number of torch threads, so on CPU they agree to the last bit (0 measured, float32 and
# float64). With other thread counts (or devices) float32 does not stay within 1e-5 over
# several steps: AdamW divides by the root of tiny second moments, so a rounding difference
# in a gradient near zero moves its weight by up to 2 lr (2.4e-4 relative measured over 8
# steps at p=4 with 1 thread against 2); float64 stays within 1e-12 there.


@dataclass(frozen=True)
class AsyncRankResult:
    """What one rank of an asynchronous run reports."""

    rank: int
    stages: tuple[int, ...]
    losses: tuple[float, ...]
    """per optimizer step, the mean loss of its microbatches (the last stage's rank; else empty)"""
    delays: dict[int, tuple[int, ...]]
    """per stage of this rank, the delay of every microbatch of the run, measured"""
    lrs: dict[int, tuple[float, ...]]
    """per stage of this rank, its learning rate at every step"""
    warmup_s: float
    """wall time of the synchronous warm-up steps"""
    async_s: float
    """wall time of the asynchronous Program (fill and drain included)"""
    step_times: tuple[float, ...] = ()
    """when each optimizer step of the rank's first stage was done (seconds, perf_counter)"""
    params: dict[tuple[int, str], object] | None = None
    """(stage, name) -> the weights after the run (verify only)"""
    versions_held: dict[int, int] | None = None
    """per stage of this rank, the most weight versions it held at once (stashes included)"""


def check_async(request: ScheduleRequest, schedule: Schedule, mode: AsyncMode, options: dict,
                emulate: object | None, precision=None) -> None:
    """Raise ValueError for what an asynchronous run cannot do (before anything starts)."""
    if precision is not None and precision.mixed:
        raise ValueError(
            f"--async with --precision {precision.name} is not supported yet (the modes' weight stashes and "
            "corrections are kept in the weights' own dtype): use --precision fp32 or fp64"
        )
    if request.mesh.dp > 1 or any(str(p) != "replicate" for p in request.sharding):
        raise ValueError(
            f"--async with --dp {request.mesh.dp} or --sharding is not supported yet: use --dp 1 --sharding replicate"
        )
    if schedule.seq_chunks > 1:
        raise ValueError("--async with sequence chunks is not supported: drop --seq-chunks")
    if request.recompute != "none":
        raise ValueError(
            f"--async with --recompute {request.recompute}: the asynchronous backward recomputes its forward "
            "already (at the mode's weights); drop --recompute"
        )
    if schedule.name not in ASYNC_FORMS:
        forms = ", ".join(ASYNC_FORMS)
        raise ValueError(
            f"--async {mode.name}: schedule {schedule.name!r} has no asynchronous form; the schedules that have one "
            f"are {forms}: use --schedule {next(iter(ASYNC_FORMS))}"
        )
    for option, flag in (("checkpoint", "--checkpoint"), ("resume", "--resume"), ("clip_grad", "--clip-grad")):
        if options.get(option):
            raise ValueError(f"--async with {flag} is not supported yet: drop {flag}")
    if options.get("verify") and emulate is not None:
        raise ValueError("--verify compares real training: drop --emulate")


def run_plan(schedule: Schedule, steps: int, mode: AsyncMode) -> tuple[Program | None, Program, WeightVersions]:
    """(the one-step Program of each warm-up step or None, the asynchronous Program, the
    versions of the whole run) for `steps` optimizer steps of `schedule.m` microbatches."""
    build = ASYNC_FORMS[schedule.name]
    p, n, w = schedule.p, schedule.m, mode.sync_warmup_steps
    program = build(p=p, n=n, steps=steps - w)
    versions = weight_versions(program)
    if not w:
        return None, program, versions
    return build(p=p, n=n, steps=1), program, WeightVersions.synchronous(schedule.num_stages, n, w).then(versions)


def launch_async(cfg: TrainConfig) -> list[AsyncRankResult]:
    from ...runtime.launch import spawn

    p = cfg.schedule.p
    return spawn(async_rank, p, args=(cfg,), timeout_s=cfg.timeout_s, threads_per_rank=cfg.threads_for(p),
                 device=cfg.mesh.device)


def _microbatches(cfg: TrainConfig, data, steps: range) -> tuple[list, list]:
    """The inputs and targets of every microbatch of `steps`, in order."""
    n = cfg.schedule.m
    xs, ys = [], []
    for k in steps:
        x, y = data.batch(k, cfg.batch_size, seed=cfg.seed)
        xs.extend(part.clone() for part in x.chunk(n))
        ys.extend(part.clone() for part in y.chunk(n))
    return xs, ys


def async_rank(ctx, cfg: TrainConfig) -> AsyncRankResult:
    """The body of one rank: build its stages, run the warm-up Programs, then the asynchronous one."""
    import torch

    from ...runtime import PipelineRunner
    from ..rank_setup import setup_rank
    from .compute import AsyncCompute
    from .stage import AsyncStage

    schedule, mode = cfg.schedule.schedule, cfg.async_mode
    n, w, last = schedule.m, mode.sync_warmup_steps, schedule.num_stages - 1
    warm, program, versions = run_plan(schedule, cfg.steps, mode)
    setup = setup_rank(ctx, cfg)
    mine, modules, data, loss_fn = tuple(sorted(setup.modules)), setup.modules, setup.data, setup.loss_fn
    stages = {
        s: AsyncStage(module, torch.optim.AdamW(module.parameters(), lr=cfg.lr), mode, versions.max_delay(s))
        for s, module in modules.items()
    }
    step_times: list[float] = []

    def on_step(stage: int, step: int) -> None:
        ctx.control.beat()
        if stage == mine[0]:
            step_times.append(time.perf_counter())

    if cfg.emulation is not None:
        from ..rank_setup import emulated_costs
        from .compute import EmulatedAsyncCompute

        compute = EmulatedAsyncCompute(emulated_costs(cfg), modules, schedule.num_stages, ctx.device, on_step=on_step)
    else:
        compute = AsyncCompute(stages, versions, loss_fn, last_stage=last, rank=ctx.rank, on_step=on_step)
    first, has_last = 0 in mine, last in mine
    xs, ys = _microbatches(cfg, data, range(cfg.steps))

    def run(prog: Program, runner, step0: int, steps: int):
        a, b = step0 * n, (step0 + steps) * n
        compute.start(prog, a, step0)
        return runner.step(xs[a:b] if first else None, ys[a:b] if has_last else None)

    def runner_for(prog: Program):
        return PipelineRunner(prog.schedule, modules, loss_fn, rank=ctx.rank, device=ctx.device,
                              timeout_s=cfg.timeout_s, compute=compute, measure_memory=False, program=prog)

    losses: list[float] = []
    torch.distributed.barrier()  # the ranks start the clock together, after building their stages
    started = time.perf_counter()
    if warm is not None:
        warm_runner = runner_for(warm)
        for k in range(w):
            losses.extend(run(warm, warm_runner, k, 1).losses)
            ctx.control.beat()
    warmed = time.perf_counter()
    losses.extend(run(program, runner_for(program), w, cfg.steps - w).losses)
    done = time.perf_counter()
    per_step = tuple(sum(losses[k * n:(k + 1) * n]) / n for k in range(cfg.steps)) if has_last else ()
    if cfg.emulation is not None:
        return AsyncRankResult(ctx.rank, tuple(mine), (), {}, {}, warmed - started, done - warmed, tuple(step_times))
    delays = {s: tuple(st.delays[mb] for mb in range(versions.microbatches)) for s, st in stages.items()}
    params = None
    if cfg.verify:
        params = {(s, name): p.detach().cpu().clone() for s, mod in modules.items() for name, p in mod.named_parameters()}
    return AsyncRankResult(ctx.rank, tuple(mine), per_step, delays, {s: tuple(v) for s, v in compute.lrs.items()},
                           warmed - started, done - warmed, tuple(step_times), params,
                           {s: st.most_versions for s, st in stages.items()})


def _launch(cfg: TrainConfig) -> list[AsyncRankResult] | None:
    from ..loop import launch_or_report

    return launch_or_report(lambda: launch_async(cfg))


def steady_step_s(results: list[AsyncRankResult], warmup_steps: int) -> float | None:
    """The steady state's time per optimizer step: over every rank, the median time between
    two consecutive steps of its first stage, the first and last asynchronous step left out
    (fill and drain); None with fewer than 4 asynchronous steps."""
    gaps = []
    for r in results:
        times = r.step_times[warmup_steps:]
        gaps.extend(b - a for a, b in zip(times[1:-2], times[2:-1]))
    return statistics.median(gaps) if gaps else None


def _describe(cfg: TrainConfig) -> str:
    s, mode = cfg.schedule, cfg.async_mode
    extra = ""
    if mode.name == "pipemare":
        extra = f" K={mode.k} D={mode.d:g}"
    elif mode.name == "nesterov":
        extra = f" D={mode.d:g}"
    return (f"asynchronous {s.name} ({mode.name}{extra}), p={s.p}, {s.m} microbatches per step, {cfg.steps} steps "
            f"({mode.sync_warmup_steps} synchronous), {cfg.model.describe()}, {cfg.precision.name}, microbatch "
            f"{cfg.microbatch_size}x{cfg.model.seq} tokens")


def _delay_lines(results: list[AsyncRankResult], w: int, n: int) -> list[str]:
    lines = ["stage  delays (min..max, asynchronous steps)"]
    for r in sorted(results, key=lambda r: r.rank):
        for s in r.stages:
            seen = r.delays[s][w * n:]
            lines.append(f"{s:>5}  {min(seen)}..{max(seen)}")
    return lines


def train_async(cfg: TrainConfig, data) -> int:
    """Train asynchronously; print loss per step, delays per stage and throughput."""
    print(f"training {_describe(cfg)} on {data.source}", flush=True)
    results = _launch(cfg)
    if results is None:
        return 1
    n, w = cfg.schedule.m, cfg.async_mode.sync_warmup_steps
    losses = next(r.losses for r in results if r.losses) if cfg.emulation is None else ()
    if not cfg.quiet:
        for k, loss in enumerate(losses):
            print(f"step {k + 1:>5}/{cfg.steps}  loss {loss:.4f}" + ("  (synchronous)" if k < w else ""))
    if cfg.emulation is None:
        print("\n".join(_delay_lines(results, w, n)))
    async_s = max(r.async_s for r in results)
    warm_s = max(r.warmup_s for r in results)
    tokens, emulated = cfg.tokens_per_step, " (emulated)" if cfg.emulation is not None else ""
    print(f"asynchronous steps: {cfg.steps - w} in {async_s:.3f} s, {tokens * (cfg.steps - w) / async_s:,.0f} "
          f"tokens/s{emulated}, fill and drain included")
    steady = steady_step_s(results, w)
    if steady is not None:
        print(f"steady state: {steady * 1e3:.1f} ms per step, {tokens / steady:,.0f} tokens/s{emulated} (median "
              "time between two optimizer steps of a stage, first and last asynchronous step left out)")
    if w:
        print(f"synchronous warm-up: {w} steps in {warm_s:.3f} s, {tokens * w / warm_s:,.0f} tokens/s{emulated}")
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


def check_against_replay(cfg: TrainConfig, data, results: list[AsyncRankResult]) -> ReplayCheck:
    """Replay `cfg`'s run in this process and compare the ranks' `results` with it."""
    import torch

    from .reference import replay
    from ..reference import TOLERANCE, relative_difference, torch_threads

    schedule, mode = cfg.schedule.schedule, cfg.async_mode
    _, program, versions = run_plan(schedule, cfg.steps, mode)
    xs, ys = _microbatches(cfg, data, range(cfg.steps))
    family = cfg.model.family_object()
    stages = family.split(family.build_model(cfg.model.config, seed=cfg.seed), schedule.num_stages)
    # the ranks' thread count: matrix products then round as on the ranks
    with torch_threads(cfg.threads_for(schedule.p)):
        expected = replay(stages, weight_versions(program), list(zip(xs, ys)), loss_fn=family.loss_fn,
                          optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr), mode=mode)
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
    print(f"verify: {_describe(cfg)}", file=sys.stderr, flush=True)
    results = _launch(cfg)
    if results is None:
        return 1
    check = check_against_replay(cfg, data, results)
    schedule, mode = cfg.schedule, cfg.async_mode
    print(f"verify asynchronous {schedule.name} {mode.name} p={schedule.p} m={schedule.m} steps={cfg.steps} "
          f"(W={mode.sync_warmup_steps}) {cfg.precision.name}: {cfg.steps} step losses vs the one-process replay, "
          f"largest relative difference {check.losses:.3g}; learning rates {check.lrs:.3g}; {check.num_weights} "
          f"weights after the run, largest relative difference {check.weights:.3g} "
          f"(stage {check.worst_weight[0]} {check.worst_weight[1]})")
    print("\n".join(_delay_lines(results, mode.sync_warmup_steps, schedule.m)))
    print(f"delays measured on the ranks {'equal' if check.delays_equal else 'DIFFER FROM'} the Program's")
    print(f"largest relative difference {check.largest:.3g}, tolerance {check.tolerance:g}: "
          f"{'OK' if check.ok else 'FAILED'}")
    return 0 if check.ok else 1
