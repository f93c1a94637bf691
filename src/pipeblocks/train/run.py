"""One `pipeblocks train` run, from a request to a report: prepare (every user error is
found here, before any process starts), then dry-run, verify, or train.

    >>> request = ScheduleRequest(name="v-half", m=4, mesh=Mesh(pp=2))
    >>> cfg, data = prepare(request, model=GPTConfig(), steps=20)
    >>> dry_run(cfg, data)            # schedule, predicted memory and time; launches nothing
    >>> train(cfg, data, report="run.json")

The CLI (`pipeblocks.cli.train`) only parses options into these arguments.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..core.request import ScheduleRequest
from ..core.jsontext import json_text
from ..core.schedule import write_atomically
from ..core.validate import validate
from ..models.config import GPTConfig
from ..schedules import names
from ..sim.build import build
from .config import TrainConfig
from .report import format_bytes

if TYPE_CHECKING:  # torch enters only when a run starts, so `pipeblocks list` stays fast
    from ..data import TokenWindows

__all__ = ["DEFAULT_SCHEDULE", "FALLBACK_SCHEDULE", "default_schedule", "prepare", "dry_run", "train", "verify", "judge"]

# Memory-efficient by default: V-Half holds about half of 1F1B's activations.
DEFAULT_SCHEDULE = "v-half"
FALLBACK_SCHEDULE = "1f1b"
WARMUP_STEPS = 2
# fp32 AdamW keeps, per parameter, the parameter, its gradient and two moments: 4+4+8 bytes;
# in units of the parameter's own size that is 1 + 1 + 2.
STATIC_COPIES = 4
# the optimistic (post-validated) step keeps a spare parameter and two spare moments
SPARE_COPIES = 3


def default_schedule() -> str:
    return DEFAULT_SCHEDULE if DEFAULT_SCHEDULE in names() else FALLBACK_SCHEDULE


def prepare(
    request: ScheduleRequest, *, model: GPTConfig, emulate: tuple[float, float, float] | None = None, **train_options,
) -> tuple[TrainConfig, TokenWindows]:
    """The run's config and data, with every user error raised here (ValueError)."""
    from ..data import TokenWindows
    from ..models.split import layer_counts

    built = build(request)  # with --sharding auto, the policies the simulator chose are in built.request
    request, schedule = built.request, built.schedule
    if train_options.get("async_mode") is not None:
        from .asynchronous.run import check_async

        check_async(request, schedule, train_options["async_mode"], train_options, emulate)
    dp = request.mesh.dp
    sharded = dp > 1 or any(str(p) != "replicate" for p in request.sharding)
    emulated_link = None
    if sharded and emulate is not None:
        emulated_link = _emulated_link(request)
    if sharded and train_options.get("clip_grad") is not None:
        raise ValueError(
            "--clip-grad is not supported with data parallelism or sharding yet (the global norm over sharded "
            "and replicated gradients): drop --clip-grad, or use --dp 1 --sharding replicate"
        )
    if train_options.get("resume") and train_options.get("overwrite"):
        raise ValueError("--resume continues the checkpoints that --overwrite would replace: choose one")
    if train_options.get("verify") and (emulate is not None or train_options.get("checkpoint")
                                        or train_options.get("resume")):
        raise ValueError("--verify runs one real step from the seed: drop --emulate, --checkpoint and --resume")
    validate(schedule)
    if schedule.seq_chunks > 1 and emulate is not None:
        raise ValueError(
            f"--emulate does not run sequence chunks (schedule {schedule.name!r} has {schedule.seq_chunks}): "
            "drop --emulate or --seq-chunks"
        )
    layer_counts(model.layers, schedule.num_stages)
    data = TokenWindows.load(train_options.get("data"), seq=model.seq)
    cfg = TrainConfig(schedule=schedule, model=model, emulate=emulate, emulated_link=emulated_link, seq_split=request.costs.seq_split,
                      dp=dp, sharding=request.sharding, recompute=tuple(built.recompute), **train_options)
    if dp > 1 and cfg.global_batch_size > data.num_windows:
        raise ValueError(
            f"--dp {dp}: a step takes dp x m x microbatch = {dp} x {schedule.m} x {cfg.microbatch_size} = "
            f"{cfg.global_batch_size} sequences but the data ({data.source}) holds only {data.num_windows} windows "
            f"of {model.seq + 1} tokens: lower --dp, -m or --microbatch-size, or give more data (--data)"
        )
    if cfg.resume:
        _check_resume(cfg, data)
    elif cfg.checkpoint:
        from . import checkpoint as ckpt
        from . import sharded_checkpoint as sharded_ckpt

        ckpt.claim_directory(cfg.checkpoint, overwrite=cfg.overwrite, dry_run=True)
        sharded_ckpt.claim_sharded(cfg.checkpoint, overwrite=cfg.overwrite, dry_run=True)
    return cfg, data


def _emulated_link(request: ScheduleRequest) -> tuple[float, float]:
    """The DP link an emulated run's collectives take (bytes/s, s per ring step): --dp-bandwidth
    (GB/s) and --dp-latency (us), else the --hardware preset's link for d replicas."""
    from ..sim.analytic import HARDWARE, dp_link

    spec = request.costs
    base = dp_link(HARDWARE[spec.hardware], request.mesh.dp)
    bandwidth = base.bandwidth if spec.dp_bandwidth is None else spec.dp_bandwidth * 1e9
    latency = base.latency if spec.dp_latency is None else spec.dp_latency * 1e-6
    return bandwidth, latency


def _check_resume(cfg: TrainConfig, data: TokenWindows) -> None:
    from . import checkpoint as ckpt
    from .loop import uses_sharded_checkpoints

    if uses_sharded_checkpoints(cfg):
        _check_sharded_resume(cfg, data)
        return
    # the ranks verify and agree again themselves (and warn about damaged files); this is
    # here so that a resume that cannot work fails before anything is launched
    checks = [ckpt.verify_rank(cfg.checkpoint, r) for r in range(cfg.schedule.p)]
    step = ckpt.agree_step(checks)
    if step is None:
        if not any(c.intact or c.damaged for c in checks):
            raise ValueError(
                f"--resume: no complete checkpoint for {cfg.schedule.p} ranks in {cfg.checkpoint!r}: "
                "drop --resume to start from step 0"
            )
        raise ValueError(f"--resume: {ckpt.no_intact_message(cfg.checkpoint, checks)}")
    ckpt.check_meta(ckpt.load_rank(cfg.checkpoint, rank=0, step=step)["meta"], cfg.meta(data.source), cfg.checkpoint)
    if step >= cfg.steps:
        raise ValueError(f"--resume: the checkpoint is at step {step} already: raise --steps above {step}")


def _check_sharded_resume(cfg: TrainConfig, data: TokenWindows) -> None:
    from . import checkpoint as ckpt
    from . import sharded_checkpoint as sharded_ckpt

    step = sharded_ckpt.latest_sharded_step(cfg.checkpoint)
    if step is None:
        raise ValueError(
            f"--resume: no complete data-parallel checkpoint (a dcp-step directory with "
            f"{sharded_ckpt.MARKER}) in {cfg.checkpoint!r}: drop --resume to start from step 0"
        )
    saved = sharded_ckpt.read_marker(cfg.checkpoint, step)["meta"]
    ckpt.check_meta(saved, sharded_ckpt.portable_meta(cfg.meta(data.source)), cfg.checkpoint)
    if step >= cfg.steps:
        raise ValueError(f"--resume: the checkpoint is at step {step} already: raise --steps above {step}")


# ---- before launch: what the run will hold and how long a step takes ----------------------
def dry_run(cfg: TrainConfig, data: TokenWindows, *, out: TextIO | None = None) -> dict:
    """Print the schedule as a text timeline, the predicted activation and static memory per
    rank and the predicted iteration time; launch nothing. Returns the figures printed.

    Activation bytes per stage are measured on this process's copy of the stage modules
    (one microbatch, the runtime's own forward and split backward); static bytes are the
    stage modules' parameters times (parameter + gradient + AdamW's two moments, and the
    optimistic step's spare parameter and moments unless `optimistic_step` is off; with data
    parallelism, what the sharding policies hold at the step's peak, replica 0:
    `runtime.static_memory`). Pass
    times are those --emulate sleeps, or measured here on one microbatch otherwise, with
    the torch threads one rank of the run would have. The timeline is drawn at unit costs
    (as `show` draws it) unless the times are emulated.
    """
    from ..core.simulate import simulate
    from ..sim.text_timeline import render_text_timeline

    from ..core.costs import Costs

    out = out or sys.stdout
    s = cfg.schedule
    stages, costs = _stage_costs(cfg, data)
    pairs = cfg.recompute_pairs
    timeline = simulate(s, costs, recompute=pairs)
    # shown as `show` shows it: measured times are not multiples of one cell, emulated ones are
    shown = timeline if cfg.emulate is not None else simulate(s, Costs(), recompute=pairs)
    if cfg.data_parallel:
        static = _static_predicted(cfg, stages)
    else:
        static = [0] * s.p
        for stage in stages:
            copies = STATIC_COPIES + (SPARE_COPIES if cfg.optimistic_step else 0)
            static[s.placement.rank_of(stage.index)] += copies * sum(
                p.numel() * p.element_size() for p in stage.parameters()
            )
    figures = {
        "schedule": s.name, "p": s.p, "m": s.m, "v": s.v, "seq_chunks": s.seq_chunks,
        "dp": cfg.dp, "sharding": [str(p) for p in cfg.sharding],
        "iteration_time_predicted_s": timeline.makespan,
        "bubble_ratio_predicted": timeline.bubble_ratio,
        "times_from": "emulate" if cfg.emulate is not None else "profiled in this process",
        "ranks": [
            {"rank": r, "stages": list(s.placement.stages_of(r)),
             "activation_bytes_predicted": timeline.peak_activation[r], "static_bytes_predicted": static[r]}
            for r in range(s.p)
        ],
    }
    print(render_text_timeline(shown), end="", file=out)
    print(f"dry run: {cfg.model.layers}-layer GPT (hidden {cfg.model.hidden}, {cfg.model.dtype}), schedule {s.name} "
          f"p={s.p} m={s.m} v={s.v}, microbatch {cfg.microbatch_size}x{cfg.model.seq} tokens"
          + (f", dp={cfg.dp} sharding {','.join(map(str, cfg.sharding))} ({cfg.world_size} processes)"
             if cfg.data_parallel else ""), file=out)
    print(f"predicted iteration time {timeline.makespan * 1e3:.1f} ms   bubble ratio {timeline.bubble_ratio:.4f}   "
          f"(pass times {figures['times_from']})", file=out)
    print("rank  stages   activation (peak)   static (params+grads+AdamW)   total", file=out)
    for row in figures["ranks"]:
        act, stat = row["activation_bytes_predicted"], row["static_bytes_predicted"]
        stages_text = ",".join(map(str, row["stages"]))
        print(f"{row['rank']:>4}  {stages_text:<7}  {format_bytes(act):>17}   {format_bytes(stat):>27}   {format_bytes(act + stat):>9}",
              file=out)
    print("nothing launched (drop --dry-run to train)", file=out)
    return figures


def _static_predicted(cfg: TrainConfig, stages) -> list[int]:
    """Peak static bytes per pipeline rank (replica 0) in a steady-state step: parameters,
    gradients and AdamW state as the mesh's policies hold them (runtime.static_memory)."""
    from ..core.lowering import lower_for
    from ..runtime.static_memory import predict_static_peak

    s = cfg.schedule
    program = lower_for(s, policies=cfg.sharding, dp=cfg.dp, recompute=cfg.recompute_pairs)
    shapes = {st.index: [tuple(p.shape) for p in st.parameters() if p.requires_grad] for st in stages}
    element_size = next(p.element_size() for st in stages for p in st.parameters())
    return [
        predict_static_peak(program, r, {i: shapes[i] for i in s.placement.stages_of(r)}, cfg.sharding, dp=cfg.dp,
                            dp_rank=0, element_size=element_size)
        for r in range(s.p)
    ]


def _stage_costs(cfg: TrainConfig, data: TokenWindows):
    """All stage modules (this process) and the costs to simulate the run with: seconds and bytes."""
    from ..core.costs import Costs
    from ..models import GPT, cross_entropy, split_gpt
    from ..models.split import layer_counts
    from ..runtime.profile import profile_chunk_memory, profile_stage_memory, profile_stage_times
    from .reference import torch_threads

    s = cfg.schedule
    x, y = data.batch(0, cfg.microbatch_size, seed=cfg.seed)
    stages = split_gpt(GPT(cfg.model, seed=cfg.seed), s.num_stages)
    memory = profile_stage_memory(stages, x, cross_entropy, y)
    seq_mem = profile_chunk_memory(stages, x, cross_entropy, y, cfg.seq_lengths()) if s.seq_chunks > 1 else None
    if cfg.emulate is not None:
        layers = layer_counts(cfg.model.layers, s.num_stages)
        f, b, w = (tuple(ms * 1e-3 * n for n in layers) for ms in cfg.emulate)
    else:
        with torch_threads(cfg.threads_for(s.p)):
            times = profile_stage_times(stages, x, cross_entropy, y)
        f, b, w = (tuple(t[i] for t in times) for i in range(3))
    total = sum(x.m_b for x in memory)
    ratio = min(1.0, sum(x.m_w for x in memory) / total) if s.has_split_backward and total > 0 else 1.0
    costs = Costs(t_f=f, t_b=b, t_w=w, mem_b=tuple(float(x.m_b) for x in memory), mem_w_ratio=ratio,
                  seq_mem=tuple(seq_mem) if seq_mem is not None else None,
                  recompute_input_ratio=tuple(x.input_ratio for x in memory))
    return stages, costs


# ---- launch --------------------------------------------------------------------------------
def _launch(cfg: TrainConfig):
    from .loop import checkpoint_note, launch, launch_or_report

    return launch_or_report(lambda: launch(cfg), note=lambda: checkpoint_note(cfg))


def train(cfg: TrainConfig, data: TokenWindows, *, report: str | None = None, plot: str | None = None) -> int:
    """Train, then print measured against simulated (and write --report / --plot)."""
    from ..models import GPT, cross_entropy, split_gpt
    from ..runtime.profile import profile_chunk_memory, profile_stage_memory
    from .report import build_report, format_report, write_timeline_plot

    s = cfg.schedule
    print(f"training {cfg.model.layers}-layer GPT (hidden {cfg.model.hidden}, {cfg.model.dtype}) on {data.source}: "
          f"schedule {s.name}, p={s.p} m={s.m} v={s.v}, microbatch {cfg.microbatch_size}x{cfg.model.seq} tokens"
          + (f" in {s.seq_chunks} chunks {list(cfg.seq_lengths())}" if s.seq_chunks > 1 else ""),
          flush=True)
    results = _launch(cfg)
    if results is None:
        return 1
    # Per-stage activation bytes of one microbatch, measured the way the runtime counts them.
    x, y = data.batch(0, cfg.microbatch_size, seed=cfg.seed)
    stages = split_gpt(GPT(cfg.model, seed=cfg.seed), s.num_stages)
    memory = profile_stage_memory(stages, x, cross_entropy, y)
    seq_mem = profile_chunk_memory(stages, x, cross_entropy, y, cfg.seq_lengths()) if s.seq_chunks > 1 else None
    warmup = min(WARMUP_STEPS, max(0, len(results[0].step_spans) - 1))
    built = build_report(s, results, memory, warmup=warmup, emulated=cfg.emulate is not None, seq_mem=seq_mem,
                         dp=cfg.dp, sharding=[str(p) for p in cfg.sharding], recompute=cfg.recompute_pairs,
                         stage_param_bytes=[sum(q.numel() * q.element_size() for q in st.parameters())
                                            for st in stages])
    skipped = [[step + 1 for step in r.skipped_steps] for r in results]
    built.data["skipped_steps"] = skipped  # 1-based, per rank
    print(format_report(built.data))
    if any(skipped):
        if all(x == skipped[0] for x in skipped):
            print(f"skipped steps {skipped[0]} (non-finite gradient) on every rank")
        else:
            print(f"skipped steps per rank {skipped} (non-finite gradient): the ranks disagree")
    if report:
        write_atomically(Path(report), json_text(built.data, indent=1) + "\n")
        print(f"report   {report}")
    plot = plot or (str(Path(report).with_suffix(".png")) if report else None)
    if plot:
        print(f"timeline {write_timeline_plot(built.measured, built.simulated, plot)}")
    else:
        print("(add --plot FILE.png, or --report FILE.json, to draw the measured timeline under the simulated one)")
    return 0


def verify(cfg: TrainConfig, data: TokenWindows) -> int:
    """One step on the ranks against one process on the whole model and the whole (global)
    batch; 0 within tolerance (`judge` says how the two are compared)."""
    # Starting p processes that each import torch takes seconds to a minute on a small
    # machine: say what is happening (on stderr, so stdout keeps only the verdict).
    started = time.monotonic()
    _progress(f"verify: starting {cfg.world_size} processes for one {cfg.schedule.name} step ...")
    results = _launch(cfg)
    if results is None:
        return 1
    _progress(f"verify: pipeline step done ({time.monotonic() - started:.0f} s); one-process reference step ...")
    largest, tolerance, lines = judge(cfg, data, results)
    print("\n".join(lines))
    return 0 if largest <= tolerance else 1


def judge(cfg: TrainConfig, data: TokenWindows, results) -> tuple[float, float, list[str]]:
    """(largest relative difference, the dtype's tolerance, the report lines) of a --verify
    step's `results` (one RankResult per process).

    The ranks take the optimizer step; the loss and every gradient (on every replica) are
    compared with one process, and every parameter after the step with the step one
    process takes from the same gradients (`reference.reference_apply`: AdamW's first
    step is a sign of each gradient element, so comparing it with the reference's own
    step would compare rounding noise on near-zero gradients). With clipping the ranks'
    step is post-validated, and the one process clips synchronously."""
    from .reference import TOLERANCE, GradDiff, compare_grads, reference_apply, reference_update, relative_difference

    loss = next(value for r in results for _, value in r.losses)
    inputs, targets = data.batch(0, cfg.global_batch_size, seed=cfg.seed)  # the step the ranks ran
    ref_loss, ref_grads, ref_params, ref_norm = reference_update(
        cfg.model, seed=cfg.seed, inputs=inputs, targets=targets, microbatches=cfg.dp * cfg.schedule.m, lr=cfg.lr,
        max_norm=cfg.clip_grad)
    worst = GradDiff("", 0.0)
    for replica in range(cfg.dp):
        mine = [r for r in results if r.dp_rank == replica]
        grads = {name: g for r in mine for name, g in (r.grads or {}).items()}
        params = {name: t for r in mine for name, t in (r.params or {}).items()}
        complete = grads.keys() == ref_grads.keys() and all(g is not None for g in grads.values())
        stepped = reference_apply(cfg.model, seed=cfg.seed, grads=grads, lr=cfg.lr) if complete else ref_params
        worst = max(worst, compare_grads(grads, ref_grads), compare_grads(params, stepped),
                    key=lambda d: d.relative)
    clipped = ""
    if cfg.clip_grad is not None:
        check = results[0].checks[0][1]
        undone = sum(1 for r in results if r.checks and r.checks[0][1].rolled_back)
        worst = max(worst, GradDiff("global norm", relative_difference(check.norm, ref_norm)), key=lambda d: d.relative)
        clipped = (f" clip-grad {cfg.clip_grad:g}: global norm {check.norm:.6g} vs one process {ref_norm:.6g}, "
                   f"{check.outcome}, {undone} rank(s) undid an optimistic step;")
    loss_diff = relative_difference(loss, ref_loss)
    tolerance = TOLERANCE[cfg.model.dtype]
    largest = max(worst.relative, loss_diff)
    s = cfg.schedule
    chunks = f" seq_chunks={s.seq_chunks} {list(cfg.seq_lengths())}" if s.seq_chunks > 1 else ""
    mesh = f" dp={cfg.dp} sharding={','.join(map(str, cfg.sharding))}" if cfg.data_parallel else ""
    pairs = cfg.recompute_pairs
    recomputed = f" recompute={len(pairs)} (stage, microbatch) pairs" if pairs else ""
    what = "gradients and weights after the " + ("clipped step" if cfg.clip_grad is not None else "optimizer step")
    lines = [f"verify {s.name} p={s.p} m={s.m}{chunks}{mesh}{recomputed} {cfg.model.dtype}:{clipped} "
             f"loss {loss:.10g} vs one process {ref_loss:.10g} (relative difference {loss_diff:.3g}); "
             f"{len(ref_grads)} {what}, largest relative difference {worst.relative:.3g} ({worst.name})"]
    if cfg.data_parallel:
        for r in sorted(results, key=lambda r: (r.dp_rank, r.rank)):
            lines.append(f"rank {r.rank} replica {r.dp_rank}: static bytes measured {r.static_bytes_measured}, "
                         f"predicted {r.static_bytes_predicted}")
    lines.append(f"largest relative difference {largest:.3g}, tolerance {tolerance:g}: "
                 f"{'OK' if largest <= tolerance else 'FAILED'}")
    return largest, tolerance, lines


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
