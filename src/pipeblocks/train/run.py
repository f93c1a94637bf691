"""One `pipeblocks train` run, from a request to a report: prepare (every user error is
found there, before any process starts: prepare.py), then dry-run, verify, or train.

    >>> request = ScheduleRequest(name="v-half", m=4, mesh=Mesh(pp=2))
    >>> cfg, data = prepare(request, model=GPTConfig(), steps=20)
    >>> dry_run(cfg, data)            # schedule, predicted memory and time; launches nothing
    >>> train(cfg, data, report="run.json")

The CLI (`pipeblocks.cli.train`) only parses options into these arguments.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..core.cost.costs import Costs
from ..core.cost.static_memory import predict_static_peak
from ..resolve.program import simulate_run
from ..schedules import names
from ..sim.hardware_profile import resolve_hardware
from ..sim.text_timeline import render_text_timeline
from .config import TrainConfig
from .describe import describe, describe_loop
from .predict import (
    predicted_times,
    profile_between_passes,
    profile_in_run_factor,
    profile_threads,
    threads_mismatch,
    with_runtime_time,
)
from .prepare import dp_units, prepare, run_lowering
from .prepare_checks import progress
from .report import build_report, format_bytes, format_report, machine_load, write_report
from .stage_copies import build_copies, one_chain, per_chain
from .tp_predict import tp_shapes, tp_stage_memory

if TYPE_CHECKING:  # torch enters only when a run starts, so `pipeblocks list` stays fast
    from ..data import TokenWindows

__all__ = [
    "DEFAULT_P", "DEFAULT_SCHEDULE", "FALLBACK_SCHEDULE", "default_schedule", "describe", "dry_run", "execute", "judge", "prepare",
    "profiled_stages", "train", "verify",
]

# Memory-efficient by default: V-Half holds about half of 1F1B's activations.
DEFAULT_SCHEDULE = "v-half"
FALLBACK_SCHEDULE = "1f1b"
# pipeline ranks of a run that does not say (`-p`): also the local ranks `calibrate` times for
DEFAULT_P = 2
WARMUP_STEPS = 2
# the optimistic (post-validated) step keeps a spare parameter and two spare moments
SPARE_COPIES = 3


def default_schedule() -> str:
    return DEFAULT_SCHEDULE if DEFAULT_SCHEDULE in names() else FALLBACK_SCHEDULE


# ---- before launch: what the run will hold and how long a step takes ----------------------
def dry_run(cfg: TrainConfig, data: TokenWindows, *, out: TextIO | None = None, hardware: str | None = None) -> dict:
    """Print the schedule as a text timeline, the predicted activation and static memory per
    rank and the predicted iteration time; launch nothing. Returns the figures printed.

    Activation bytes per stage are measured on this process's copy of the stage modules
    (one microbatch, the runtime's own forward and split backward, in the run's compute
    dtype); static bytes are what the precision and the sharding policies hold at the
    step's peak (`core.cost.static_memory.predict_static_peak`: parameters, gradients, AdamW's
    two moments, bf16-mixed's compute copy), plus, without data parallelism, the
    optimistic step's spare parameter and moments unless `optimistic_step` is off. Pass
    times are those --emulate sleeps, or measured here on one microbatch otherwise, with
    the torch threads one rank of the run would have; with `hardware` (a preset or a
    `pipeblocks calibrate` profile) they are predicted from it (`predict.predicted_times`),
    with its link's hop time. The timeline is drawn at unit costs (as `show` draws it)
    unless the times are emulated.
    """
    out = out or sys.stdout
    s = cfg.schedule
    stages, costs = _stage_costs(cfg, data, hardware)
    pairs = s.recompute
    timeline = simulate_run(s.schedule, costs, recompute=pairs, recompute_at=s.recompute_anchors)
    # shown as `show` shows it: measured times are not multiples of one cell, emulated ones are
    shown = timeline if cfg.emulation is not None else simulate_run(s.schedule, Costs(), recompute=pairs)
    static = _static_predicted(cfg, stages)
    threads = _threads_against_profile(cfg, hardware)
    figures = {
        "schedule": s.name, "p": s.p, "m": s.m, "v": s.v, "seq_chunks": s.seq_chunks,
        "model": cfg.model.to_json(), "precision": cfg.precision.name,
        "dp": cfg.dp, "sharding": [str(p) for p in cfg.sharding],
        "iteration_time_predicted_s": timeline.makespan,
        "bubble_ratio_predicted": timeline.bubble_ratio,
        "times_from": "emulate" if cfg.emulation is not None else _times_from(cfg, hardware),
        **threads,
        "ranks": [
            {"rank": r, "stages": list(s.placement.stages_of(r)),
             "activation_bytes_predicted": timeline.peak_activation[r], "static_bytes_predicted": static[r]}
            for r in range(s.p)
        ],
    }
    print(render_text_timeline(shown), end="", file=out)
    print(f"dry run: {describe(cfg)}", file=out)
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
    gradients, AdamW state and bf16-mixed's compute copies as the precision and the mesh's
    policies hold them (core.cost.static_memory); without data parallelism also the
    optimistic step's spare parameter and two moments (in the master dtype)."""
    s = cfg.schedule
    # the run's Program at chunk grain, without vocabulary passes: the static peak is priced per chunk
    program = dataclasses.replace(run_lowering(cfg), units=None, vocab=None).program(s.schedule)
    # by global stage: the stages come in global order (DualPipe's copies: both, so 2x parameters per rank)
    shapes = {i: [tuple(p.shape) for p in st.parameters() if p.requires_grad] for i, st in enumerate(stages)}
    if cfg.tp > 1:  # one tensor-parallel rank's share
        shapes = tp_shapes(cfg, stages)
    # the optimistic step (and its spare copies) runs without data and tensor parallelism only
    spare = SPARE_COPIES * cfg.precision.master_bytes if cfg.optimistic_step and not cfg.data_parallel and cfg.tp == 1 else 0
    return [
        predict_static_peak(program, r, {i: shapes[i] for i in s.placement.stages_of(r)}, cfg.sharding, dp=cfg.dp,
                            dp_rank=0, precision=cfg.precision)
        + spare * sum(math.prod(shape) for i in s.placement.stages_of(r) for shape in shapes[i])
        for r in range(s.p)
    ]


def profiled_stages(cfg: TrainConfig):
    """All stage modules of the run's model in this process, in the compute dtype (bf16-mixed:
    bfloat16 weights, which save what the ranks' compute copies save), and the loss function.
    A pretrained model is profiled with weights drawn from the seed instead of its own: what
    a pass saves and how long it takes do not depend on the values, and nothing is read."""
    from ..models.build import build_stages  # torch: the command line imports this module without it
    from ..models.init import normal_init
    from ..runtime.precision import torch_dtype

    spec = cfg.model.spec()
    if spec.weights is not None:  # drawn from the seed instead
        spec = dataclasses.replace(spec, weights=None, init=normal_init)
    dtype = torch_dtype(cfg.precision.compute if cfg.precision.mixed else cfg.precision.master)
    if cfg.schedule.schedule.chains > 1:  # DualPipe: every model stage once per chain, in global stage order
        copies = build_copies(spec, cfg.schedule.schedule, range(cfg.num_stages), seed=cfg.seed, dtype=dtype)
        return [copies[s] for s in range(cfg.num_stages)], spec.loss
    stages = build_stages(spec, seed=cfg.seed, num_stages=cfg.num_stages, stages=range(cfg.num_stages), dtype=dtype,
                          counts=cfg.stage_layers)
    return stages, spec.loss


def _times_from(cfg: TrainConfig, hardware: str | None) -> str:
    if hardware is None:
        return "profiled in this process"

    threads, mine = profile_threads(hardware), cfg.threads_for(_local_ranks(cfg))
    other = (f"; measured with {threads} torch threads, a rank here has {mine}"
             if cfg.mesh.device == "cpu" and threads not in (None, mine) else "")
    chunks = cfg.schedule.schedule.num_stages // cfg.schedule.p
    factor = profile_in_run_factor(hardware, chunks)
    inside = f", x {factor:.2f} as inside a run of {chunks} chunk(s) per rank" if factor else ""
    return f"predicted from hardware {hardware}{inside}{other}"


def _threads_against_profile(cfg: TrainConfig, hardware: str | None) -> dict:
    """With a profile on a CPU run: the dry run's figures `threads_per_rank` and
    `profile_threads`, and a warning on stderr when they differ (the prediction is then for
    another speed; `predict.threads_mismatch` names the fix)."""
    if hardware is None or cfg.emulation is not None or cfg.mesh.device != "cpu":
        return {}

    ranks = _local_ranks(cfg)
    mine = cfg.threads_for(ranks)
    warning = threads_mismatch(hardware, threads=mine, local_ranks=ranks, cores=os.cpu_count() or 1)
    if warning is not None:
        progress(warning)
    return {"threads_per_rank": mine, "profile_threads": profile_threads(hardware)}


def _stage_costs(cfg: TrainConfig, data: TokenWindows, hardware: str | None = None):
    """All stage modules (this process) and the costs to simulate the run with: seconds and bytes."""
    # torch: --dry-run profiles the stages, which `pipeblocks list` and the CLI's parsing must not import
    from ..runtime.profile import profile_stage_times
    from .rank_setup import emulated_costs
    from .reference import torch_threads

    s = cfg.schedule
    x, y = data.batch(0, cfg.microbatch_size, seed=cfg.seed)
    stages, loss_fn = profiled_stages(cfg)
    chain = one_chain(s.schedule, stages)  # DualPipe: one direction profiled, its figures repeated for the other
    memory, seq_mem = _profiled_memory(cfg, stages, loss_fn, x, y)
    t_comm = 0.0
    if cfg.emulation is not None:
        ms = emulated_costs(cfg).sim_costs(s.schedule)
        f, b, w = (tuple(t * 1e-3 for t in times) for times in (ms.t_f, ms.t_b, ms.t_w))
    elif hardware is not None:
        f, b, w, t_comm = predicted_times(chain, x, loss_fn, y, resolve_hardware(hardware),
                                          split=s.schedule.has_split_backward)
        f, b, w = (per_chain(s.schedule, t) for t in (f, b, w))
        factor = profile_in_run_factor(hardware, s.schedule.num_stages // s.p) or 1.0  # as inside a run
        f, b, w = (tuple(t * factor for t in times) for times in (f, b, w))
        f, b, w = with_runtime_time(f, b, w, profile_between_passes(hardware), split=s.schedule.has_split_backward)
    else:
        with torch_threads(cfg.threads_for(_local_ranks(cfg))):  # as a rank of the run (p x dp x tp)
            times = per_chain(s.schedule, profile_stage_times(chain, x, loss_fn, y))
        f, b, w = (tuple(t[i] for t in times) for i in range(3))
    total = sum(x.m_b for x in memory)
    ratio = min(1.0, sum(x.m_w for x in memory) / total) if s.schedule.has_split_backward and total > 0 else 1.0
    costs = Costs(t_f=f, t_b=b, t_w=w, t_comm=t_comm, mem_b=tuple(float(x.m_b) for x in memory), mem_w_ratio=ratio,
                  seq_mem=tuple(seq_mem) if seq_mem is not None else None,
                  recompute_input_ratio=tuple(x.input_ratio for x in memory))
    return stages, costs


def _profiled_memory(cfg: TrainConfig, stages, loss_fn, x, y):
    """Per stage, the activation bytes one microbatch saves, measured the way the runtime
    counts them (one tensor-parallel rank's share), and with sequence chunks each chunk's."""
    from ..runtime.profile import profile_chunk_memory, profile_stage_memory  # torch, as in _stage_costs

    s = cfg.schedule
    memory = per_chain(s.schedule, profile_stage_memory(one_chain(s.schedule, stages), x, loss_fn, y))
    if cfg.tp > 1:  # what one tensor-parallel rank saves of the whole stages profiled here
        memory = tp_stage_memory(cfg, memory)
    return memory, profile_chunk_memory(stages, x, loss_fn, y, s.seq_lengths) if s.seq_chunks > 1 else None


# ---- launch --------------------------------------------------------------------------------
def execute(cfg: TrainConfig, data: TokenWindows, *, dry: bool = False, report: str | None = None,
            plot: str | None = None, hardware: str | None = None) -> int:
    """Run what the command line asked for: the one place where synchronous and asynchronous
    training part ways (`--dry-run`, `--verify`, or training with its report). `hardware`:
    the dry run's pass times from this profile instead of profiled here."""
    if cfg.async_mode is not None:
        from .asynchronous import run as asynchronous  # torch, as in train

        if cfg.verify:
            return asynchronous.verify_async(cfg, data)
        return asynchronous.train_async(cfg, data, report=report, plot=plot)
    if dry:
        dry_run(cfg, data, hardware=hardware)
        return 0
    if cfg.verify:
        return verify(cfg, data)
    return train(cfg, data, report=report, plot=plot)


def train(cfg: TrainConfig, data: TokenWindows, *, report: str | None = None, plot: str | None = None) -> int:
    """Train, then print measured against simulated (and write --report / --plot)."""
    from .loop import launch_reported, reporting_process  # torch: only a run that trains

    s = cfg.schedule
    if reporting_process():
        print(f"training {describe(cfg)} on {describe_loop(cfg, data)}", flush=True)
    results = launch_reported(cfg)
    if not reporting_process():
        return 0  # under torchrun, global rank 0 reports
    if results is None:
        return 1
    results = [r for r in results if r.tp_rank == 0]  # one row per (pipeline rank, replica)
    x, y = data.batch(0, cfg.microbatch_size, seed=cfg.seed)
    stages, loss_fn = profiled_stages(cfg)
    memory, seq_mem = _profiled_memory(cfg, stages, loss_fn, x, y)
    warmup = min(WARMUP_STEPS, max(0, len(results[0].step_spans) - 1))
    built = build_report(
        s.schedule, tuple(results), tuple(memory), warmup=warmup, emulated=cfg.emulation is not None, seq_mem=seq_mem,
        dp=cfg.dp, sharding=tuple(str(p) for p in cfg.sharding), recompute=s.recompute, recompute_at=s.recompute_anchors,
        stage_param_bytes=tuple(sum(q.numel() for q in st.parameters()) * cfg.precision.master_bytes for st in stages),
        dp_units=dp_units(cfg), tokens_per_step=cfg.tokens_per_step, vocab=run_lowering(cfg).vocab)
    built.data["model"] = cfg.model.to_json()
    built.data["precision"] = cfg.precision.name
    built.data["device"] = cfg.mesh.device
    built.data.update(machine_load(_local_ranks(cfg), cfg.mesh.device))  # ranks sharing cores: a note
    skipped = [[step + 1 for step in r.skipped_steps] for r in results]
    built.data["skipped_steps"] = skipped  # 1-based, per rank
    print(format_report(built.data))
    if any(skipped):
        if all(x == skipped[0] for x in skipped):
            print(f"skipped steps {skipped[0]} (non-finite gradient) on every rank")
        else:
            print(f"skipped steps per rank {skipped} (non-finite gradient): the ranks disagree")
    if cfg.save_hf is not None:
        from .export_hf import finish_save  # torch, as in train

        files = finish_save(cfg)
        print(f"saved    {cfg.save_hf} (Hugging Face: config.json, {len(files)} safetensors file(s)"
              f"{', tokenizer' if (Path(cfg.save_hf) / 'tokenizer.json').exists() else ''})")
    for line in write_report(built, report, plot) or [
            "(add --plot FILE.png, or --report FILE.json, to draw the measured timeline under the simulated one)"]:
        print(line)
    return 0


def _local_ranks(cfg: TrainConfig) -> int:
    """The run's processes on this machine (torchrun: this node's)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size))


def verify(cfg: TrainConfig, data: TokenWindows) -> int:
    """One step on the ranks against one process on the whole model and the whole (global)
    batch; 0 within tolerance (`judge` says how the two are compared)."""
    from .loop import launch_reported, reporting_process  # torch, as in train

    # Starting p processes that each import torch takes seconds to a minute on a small
    # machine: say what is happening (on stderr, so stdout keeps only the verdict).
    started = time.monotonic()
    if reporting_process():
        progress(f"verify: starting {cfg.world_size} processes for one {cfg.schedule.name} step ...")
    results = launch_reported(cfg)
    if not reporting_process():
        return 0
    if results is None:
        return 1
    progress(f"verify: pipeline step done ({time.monotonic() - started:.0f} s); one-process reference step ...")
    largest, tolerance, lines = judge(cfg, data, results)
    print("\n".join(lines))
    return 0 if largest <= tolerance else 1


def judge(cfg: TrainConfig, data: TokenWindows, results) -> tuple[float, float, list[str]]:
    """(largest relative difference, the precision's tolerance, the report lines) of a
    --verify step's `results` (one RankResult per process).

    The ranks take the optimizer step; the loss and every gradient (on every replica) are
    compared with one process (in the same precision, `reference.reference_update`), and
    every parameter after the step with the step one process takes from the same gradients
    (`reference.reference_apply`: AdamW's first step is a sign of each gradient element,
    so comparing it with the reference's own step would compare rounding noise on
    near-zero gradients). With clipping the ranks' step is post-validated, and the one
    process clips synchronously."""
    # torch: the reference steps run in this process only under --verify
    from .reference import ROUNDING_NOISE_FACTOR, ExcessError, GradDiff, compare_grads, excess_error, in_float64
    from .reference import reference_apply, reference_update, relative_difference, torch_threads

    loss = next(value for r in results for _, value in r.losses)
    inputs, targets = data.batch(0, cfg.global_batch_size, seed=cfg.seed)  # the step the ranks ran
    with torch_threads(cfg.threads_for(cfg.world_size)):  # products round as on the ranks
        ref_loss, ref_grads, ref_params, ref_norm = reference_update(
            cfg.model, seed=cfg.seed, inputs=inputs, targets=targets, microbatches=cfg.dp * cfg.schedule.m,
            lr=cfg.lr_at(0), max_norm=cfg.clip_grad, precision=cfg.precision)
    truth = None
    if cfg.schedule.vocab_parallel and cfg.precision.mixed:  # other arithmetic: judged against float64 (excess_error)
        with torch_threads(cfg.threads_for(cfg.world_size)):
            _, truth, _, _ = reference_update(in_float64(cfg.model), seed=cfg.seed, inputs=inputs, targets=targets,
                                              microbatches=cfg.dp * cfg.schedule.m, lr=cfg.lr_at(0),
                                              max_norm=cfg.clip_grad)
    worst, excess = GradDiff("", 0.0), ExcessError("", -math.inf, 0.0)
    for replica in range(cfg.dp):
        ranks = [r for r in results if r.dp_rank == replica]
        # DualPipe: rank r and rank p-1-r hold the two copies of a model stage; taking the ranks
        # in both orders compares each copy (the later rank's names win)
        for mine in (ranks, ranks[::-1]) if cfg.schedule.schedule.chains > 1 else (ranks,):
            grads = {name: g for r in mine for name, g in (r.grads or {}).items()}
            params = {name: t for r in mine for name, t in (r.params or {}).items()}
            complete = grads.keys() == ref_grads.keys() and all(g is not None for g in grads.values())
            stepped = reference_apply(cfg.model, seed=cfg.seed, grads=grads, lr=cfg.lr_at(0)) if complete else ref_params
            if truth is None:
                worst = max(worst, compare_grads(grads, ref_grads), key=lambda d: d.relative)
            else:
                excess = max(excess, excess_error(grads, ref_grads, truth), key=lambda d: d.relative)
            worst = max(worst, compare_grads(params, stepped), key=lambda d: d.relative)
    clipped = ""
    if cfg.clip_grad is not None:
        check = results[0].checks[0][1]
        undone = sum(1 for r in results if r.checks and r.checks[0][1].rolled_back)
        worst = max(worst, GradDiff("global norm", relative_difference(check.norm, ref_norm)), key=lambda d: d.relative)
        clipped = (f" clip-grad {cfg.clip_grad:g}: global norm {check.norm:.6g} vs one process {ref_norm:.6g}, "
                   f"{check.outcome}, {undone} rank(s) undid an optimistic step;")
    loss_diff = relative_difference(loss, ref_loss)
    tolerance = verify_tolerance(cfg)
    largest = max(worst.relative, loss_diff)
    s = cfg.schedule
    chunks = f" seq_chunks={s.seq_chunks} {list(s.seq_lengths)}" if s.seq_chunks > 1 else ""
    mesh = f" dp={cfg.dp} sharding={','.join(map(str, cfg.sharding))}" if cfg.data_parallel else ""
    mesh += f" tp={cfg.tp}" if cfg.tp > 1 else ""
    recomputed = f" recompute={len(s.recompute)} (stage, microbatch) pairs" if s.recompute else ""
    what = ("weights" if truth is not None else "gradients and weights") + " after the " + (
        "clipped step" if cfg.clip_grad is not None else "optimizer step")
    lines = [f"verify {cfg.model.family} {s.name} p={s.p} m={s.m}{chunks}{mesh}{recomputed} {cfg.precision.name}:"
             f"{clipped} loss {loss:.10g} vs one process {ref_loss:.10g} (relative difference {loss_diff:.3g}); "
             f"{len(ref_grads)} {what}, largest relative difference {worst.relative:.3g} ({worst.name})"]
    if truth is not None:
        largest = max(largest, excess.relative)
        lines[0] += (f"; gradients against float64 (vocabulary parallelism rounds elsewhere than one process): "
                     f"closest to its bound {excess.name}, {excess.pipeline:.3g} from float64 where one process in "
                     f"{cfg.precision.compute} is {excess.one_process:.3g} (allowed: tolerance + "
                     f"{ROUNDING_NOISE_FACTOR:g} x that; excess {excess.relative:.3g})")
    if cfg.data_parallel or cfg.tp > 1:
        for r in sorted(results, key=lambda r: (r.dp_rank, r.rank, r.tp_rank)):
            tp_rank = f" tp rank {r.tp_rank}" if cfg.tp > 1 else ""
            lines.append(f"rank {r.rank} replica {r.dp_rank}{tp_rank}: static bytes measured "
                         f"{r.static_bytes_measured}, predicted {r.static_bytes_predicted}")
    lines.append(f"largest relative difference {largest:.3g}, tolerance {tolerance:g}: "
                 f"{'OK' if largest <= tolerance else 'FAILED'}")
    return largest, tolerance, lines


def verify_tolerance(cfg: TrainConfig) -> float:
    """The largest relative difference `--verify` accepts for this run (reference.TOLERANCE by
    precision). Tensor parallelism splits the sums of a replicated norm's weight gradient over
    the tp ranks: under bf16-mixed that rounds more often (TP_BF16_TOLERANCE), and a model whose
    norms compute in float32 whatever its dtype (`ModelSpec.float32_norms`: Gemma's) then
    agrees with one process in float64 to float32's rounding, not float64's."""
    from .reference import TOLERANCE, TP_BF16_TOLERANCE  # torch, as in judge

    if cfg.tp > 1 and cfg.precision.mixed:
        return TP_BF16_TOLERANCE
    if cfg.tp > 1 and cfg.precision.name == "fp64" and cfg.model.spec().float32_norms:
        return TOLERANCE["fp32"]
    return TOLERANCE[cfg.precision.name]
