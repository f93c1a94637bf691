"""`pipeblocks train`: train the reference GPT with a schedule, one local process per rank.

    pipeblocks train                                         # 8-layer GPT, v-half, p=2, m=4, 40 steps
    pipeblocks train --schedule 1f1b -p 4 -m 8 --steps 20 --report run.json   # + run.png
    pipeblocks train --schedule zb-h1 -p 2 -m 4 --dtype float64 --verify      # one step vs one process
    pipeblocks train --schedule 1f1b -p 2 -m 4 --emulate 5,5,3 --steps 5   # sleep 5/5/3 ms per layer
    pipeblocks train --schedule seq1f1b -p 2 -m 4 --seq 256 --seq-chunks 4 --seq-split balanced
    pipeblocks train --schedule zb-h1 --seq-chunks 2 --dtype float64 --verify   # any schedule, split by sequence
    pipeblocks train --data notes.txt --seq 128 --layers 8 --hidden 128 --heads 8
    pipeblocks train --checkpoint ckpt --steps 20            # then, to continue to step 40:
    pipeblocks train --checkpoint ckpt --steps 40 --resume

Each step prints `step, loss, tokens/s`. At the end it prints, per rank, the measured peak
saved-activation bytes beside the simulator's prediction, and the measured iteration time
and bubble beside the simulated ones, with costs profiled from this run (report.py in
pipeblocks.train). `--report FILE` writes that as JSON and `--plot FILE` (default: the
report's name with .png) draws the measured timeline under the simulated one.

`--verify` runs one step and compares the loss and every gradient with one process
training the whole model: it prints the largest relative difference and exits 1 beyond
the tolerance (float64 1e-10, float32 1e-5).

`--seq-chunks K` cuts every microbatch into K sequence chunks (Seq1F1B, ALGORITHMS.md §5):
seq1f1b and seq1f1b-i take it directly (default 2), any other schedule is composed with
`split_sequence`. `--seq-split` chooses equal-FLOP ("balanced", the default) or equal-token
chunks; the report's predicted memory uses each chunk's measured share.

Bad input (unknown schedule, m the schedule cannot take, layers < stages, a sequence
longer than the data, more sequence chunks than tokens) is reported before any process
starts, with exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.schedule import Schedule, write_atomically
from ..core.validate import validate
from ..models.config import GPTConfig
from ..schedules import names
from ..train.config import TrainConfig
from .common import build_schedule

if TYPE_CHECKING:  # torch enters only when the command runs, so `pipeblocks list` stays fast
    from ..data import TokenWindows

__all__ = ["register", "run", "DEFAULT_SCHEDULE"]

# Memory-efficient by default: V-Half holds about half of 1F1B's activations.
DEFAULT_SCHEDULE = "v-half"
FALLBACK_SCHEDULE = "1f1b"
WARMUP_STEPS = 2


def register(sub) -> None:
    parser = sub.add_parser(
        "train", help="train the reference GPT with a schedule on local processes; report measured vs simulated",
        description=__doc__.split("\n\n")[0],
    )
    run_opts = parser.add_argument_group("schedule")
    run_opts.add_argument("--schedule", default=None,
                          help=f"schedule name (default {DEFAULT_SCHEDULE}, or {FALLBACK_SCHEDULE} if absent)")
    run_opts.add_argument("-p", type=int, default=2, help="pipeline ranks = local processes (default 2)")
    run_opts.add_argument("-m", type=int, default=4, help="microbatches per step (default 4)")
    run_opts.add_argument("-v", type=int, default=None, help="chunks per rank, for looped schedules")
    run_opts.add_argument("--group-size", type=int, default=None, help="interleaved-1f1b: microbatches per group")
    run_opts.add_argument("--memory-limit", type=float, default=None,
                          help="activation budget per rank, in units of one stage's activation (1F1B's peak is p)")
    run_opts.add_argument("--seq-chunks", type=int, default=None, metavar="K",
                          help="cut every microbatch into K sequence chunks (Seq1F1B; composes with any schedule; "
                          "seq1f1b and seq1f1b-i default to 2)")
    run_opts.add_argument("--seq-split", default="balanced", choices=("balanced", "even"),
                          help="sequence chunk boundaries: equal FLOPs under causal attention, or equal tokens "
                          "(default balanced)")
    model = parser.add_argument_group("model and data")
    # defaults come from GPTConfig and TrainConfig, the one place they are set
    model.add_argument("--layers", type=int, default=GPTConfig.layers,
                       help=f"transformer blocks (default {GPTConfig.layers}: enough for V schedules up to p=4)")
    model.add_argument("--hidden", type=int, default=GPTConfig.hidden, help=f"model width (default {GPTConfig.hidden})")
    model.add_argument("--heads", type=int, default=GPTConfig.heads,
                       help=f"attention heads (default {GPTConfig.heads})")
    model.add_argument("--seq", type=int, default=GPTConfig.seq, help=f"tokens per sequence (default {GPTConfig.seq})")
    model.add_argument("--dtype", default=GPTConfig.dtype, choices=("float32", "float64"),
                       help=f"default {GPTConfig.dtype}")
    model.add_argument("--data", default=None, metavar="FILE",
                       help="a text file to train on (default: Python's own pydoc topics, no download)")
    train = parser.add_argument_group("training")
    train.add_argument("--microbatch-size", type=int, default=TrainConfig.microbatch_size,
                       help=f"sequences per microbatch (default {TrainConfig.microbatch_size})")
    train.add_argument("--steps", type=int, default=TrainConfig.steps,
                       help=f"optimizer steps in all (default {TrainConfig.steps})")
    train.add_argument("--lr", type=float, default=TrainConfig.lr,
                       help=f"AdamW learning rate (default {TrainConfig.lr:g})")
    train.add_argument("--seed", type=int, default=TrainConfig.seed, help="weights and data order (default 0)")
    train.add_argument("--checkpoint", default=None, metavar="DIR", help="save per-rank checkpoints here")
    train.add_argument("--save-every", type=int, default=0, metavar="N", help="also save every N steps")
    train.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint")
    train.add_argument("--timeout", type=float, default=300.0, metavar="S",
                       help="seconds before a stuck run is stopped (default 300)")
    train.add_argument("--quiet", action="store_true", help="no per-step lines")
    out = parser.add_argument_group("checks and output")
    out.add_argument("--verify", action="store_true",
                     help="run one step; compare loss and every gradient with one process; exit 1 beyond tolerance")
    out.add_argument("--emulate", default=None, metavar="F_MS,B_MS,W_MS",
                     help="sleep F/B/W milliseconds per layer and microbatch instead of computing (times only)")
    out.add_argument("--report", default=None, metavar="FILE", help="write the measured-vs-simulated report as JSON")
    out.add_argument("--plot", default=None, metavar="FILE",
                     help="timeline plot, .png or .svg (default: beside --report, same name, .png)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    cfg, data = _prepare(args)
    if args.verify:
        return _verify(cfg, data)
    return _train(cfg, data, args)


# ---- before launch: every user error is found here -------------------------------------
def _prepare(args: argparse.Namespace) -> tuple[TrainConfig, TokenWindows]:
    from ..data import ByteTokenizer, TokenWindows
    from ..models.split import layer_counts

    model = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                      vocab=ByteTokenizer.vocab_size, dtype=args.dtype)
    emulate = _parse_emulate(args.emulate)
    if args.verify and (emulate is not None or args.checkpoint or args.resume):
        raise ValueError("--verify runs one real step from the seed: drop --emulate, --checkpoint and --resume")
    schedule = _schedule(args, emulate)
    layer_counts(model.layers, schedule.num_stages)
    data = TokenWindows.load(args.data, seq=model.seq)
    cfg = TrainConfig(
        schedule=schedule, model=model, microbatch_size=args.microbatch_size, steps=args.steps, lr=args.lr,
        seed=args.seed, data=args.data, checkpoint=args.checkpoint, resume=args.resume, save_every=args.save_every,
        emulate=emulate, verify=args.verify, timeout_s=args.timeout, quiet=args.quiet, seq_split=args.seq_split,
    )
    if cfg.resume:
        _check_resume(cfg, data)
    return cfg, data


def _schedule(args: argparse.Namespace, emulate: tuple[float, float, float] | None) -> Schedule:
    name = args.schedule or (DEFAULT_SCHEDULE if DEFAULT_SCHEDULE in names() else FALLBACK_SCHEDULE)
    # cost-aware generators see the emulated ratios (unit costs otherwise)
    costs = None if emulate is None else ",".join(map(str, emulate))
    ns = argparse.Namespace(
        p=args.p, m=args.m, v=args.v, group_size=args.group_size, memory_limit=args.memory_limit, file=None,
        seq_chunks=args.seq_chunks, costs=costs, mem_w_ratio=None, model=None, hardware=None,
    )
    schedule = build_schedule(ns, name)
    validate(schedule)
    if schedule.seq_chunks > 1 and emulate is not None:
        raise ValueError(
            f"--emulate does not run sequence chunks (schedule {schedule.name!r} has {schedule.seq_chunks}): "
            "drop --emulate or --seq-chunks"
        )
    return schedule


def _parse_emulate(text: str | None) -> tuple[float, float, float] | None:
    if text is None:
        return None
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3 or any(v < 0 for v in values):
        raise ValueError(f"--emulate {text!r}: expected three milliseconds F_MS,B_MS,W_MS >= 0, e.g. 20,20,10")
    return (values[0], values[1], values[2])


def _check_resume(cfg: TrainConfig, data: TokenWindows) -> None:
    from ..train import checkpoint as ckpt

    step = ckpt.latest_step(cfg.checkpoint, cfg.schedule.p)
    if step is None:
        raise ValueError(
            f"--resume: no complete checkpoint for {cfg.schedule.p} ranks in {cfg.checkpoint!r}: "
            "drop --resume to start from step 0"
        )
    ckpt.check_meta(ckpt.load_rank(cfg.checkpoint, rank=0, step=step)["meta"], cfg.meta(data.source), cfg.checkpoint)
    if step >= cfg.steps:
        raise ValueError(f"--resume: the checkpoint is at step {step} already: raise --steps above {step}")


# ---- after launch -----------------------------------------------------------------------
def _launch(cfg: TrainConfig):
    from ..runtime import RankFailedError
    from ..train.loop import launch

    try:
        return launch(cfg)
    except (RankFailedError, TimeoutError) as err:
        print(f"pipeblocks train: {err}", file=sys.stderr)
        return None


def _train(cfg: TrainConfig, data: TokenWindows, args: argparse.Namespace) -> int:
    from ..models import GPT, cross_entropy, split_gpt
    from ..runtime import profile_stage_memory
    from ..runtime.memory import profile_chunk_memory
    from ..train.report import build_report, format_report, write_timeline_plot

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
    report = build_report(s, results, memory, warmup=warmup, emulated=cfg.emulate is not None, seq_mem=seq_mem)
    print(format_report(report.data))
    if args.report:
        write_atomically(Path(args.report), json.dumps(report.data, indent=1) + "\n")
        print(f"report   {args.report}")
    plot = args.plot or (str(Path(args.report).with_suffix(".png")) if args.report else None)
    if plot:
        print(f"timeline {write_timeline_plot(report.measured, report.simulated, plot)}")
    else:
        print("(add --plot FILE.png, or --report FILE.json, to draw the measured timeline under the simulated one)")
    return 0


def _verify(cfg: TrainConfig, data: TokenWindows) -> int:
    from ..train.reference import TOLERANCE, compare_grads, reference_step, relative_difference

    results = _launch(cfg)
    if results is None:
        return 1
    grads = {name: g for r in results for name, g in (r.grads or {}).items()}
    loss = next(l for r in results for _, l in r.losses)
    inputs, targets = data.batch(0, cfg.batch_size, seed=cfg.seed)  # the step the ranks ran
    ref_loss, ref_grads = reference_step(cfg.model, seed=cfg.seed, inputs=inputs, targets=targets,
                                         microbatches=cfg.schedule.m)
    worst = compare_grads(grads, ref_grads)
    loss_diff = relative_difference(loss, ref_loss)
    tolerance = TOLERANCE[cfg.model.dtype]
    largest = max(worst.relative, loss_diff)
    ok = largest <= tolerance
    chunks = f" seq_chunks={cfg.schedule.seq_chunks} {list(cfg.seq_lengths())}" if cfg.schedule.seq_chunks > 1 else ""
    print(f"verify {cfg.schedule.name} p={cfg.schedule.p} m={cfg.schedule.m}{chunks} {cfg.model.dtype}: "
          f"loss {loss:.10g} vs one process {ref_loss:.10g} (relative difference {loss_diff:.3g}); "
          f"{len(ref_grads)} gradients, largest relative difference {worst.relative:.3g} ({worst.name})")
    print(f"largest relative difference {largest:.3g}, tolerance {tolerance:g}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1
