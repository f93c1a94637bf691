"""The PipeMare study: asynchronous training modes against synchronous 1F1B on a small GPT.

    python benchmarks/pipemare.py [--quick] [--configs 4x1 8x1] [--steps 300] [--lrs 0.003 0.03]
                                  [--variants naive pipemare ...] [--seeds 0 1 2] [--optimizer adam|sgd]
                                  [--plot benchmarks/out/pipemare.png] [--json FILE]

Fine-grained pipelines: the reference GPT with one transformer block per stage (the
embedding rides on stage 0, the head on the last), p stages, N microbatches per optimizer
step (`--configs PxN`), so delays are large: up to p-1 steps at N = 1. The data is the
embedded corpus (byte tokens); every variant of one configuration sees the same
microbatches and starts from the same weights. Training runs through the one-process
replay (`pipeblocks.train.asynchronous.reference.replay`), which is the specification of each
mode that the multi-process runtime is verified against: its losses are the ones the
runtime would produce. Optimizer (`--optimizer`): Adam (the default) or SGD with momentum 0.9,
constant base learning rate (`--lr-schedule default`: `pipeblocks train`'s warm-up and
cosine instead), at a normal and an aggressive rate (`--lrs`; the defaults per
optimizer, 0.003 / 0.03 for Adam and 0.03 / 0.3 for SGD, were each picked once from a short
probe of sync and naive: the aggressive rate is one at which naive asynchrony is clearly
worse than sync or diverges).

Variants: sync (1F1B with a flush every step: delay 0), naive, pipedream (weight
stashing), pipemare (T1 and T2), pipemare-T1 (D = 1), pipemare-T2 (K = 0), pipemare+W and
naive+W (W synchronous warm-up steps first), nesterov (forward look-ahead along the
velocity EMA) and nesterov+W. K (T1's annealing) is the library's default share of the
steps (`--k-share` another), W = steps/10, D = the library's default.

Columns:
    final      evaluation loss of the final weights: mean next-token cross-entropy over a
               fixed set of windows drawn with another data seed (not the training
               batches, though from the same corpus, so some text may overlap)
    ratio      final / final of sync at the same configuration and rate
    to target  first step at which the loss, averaged over the last `window` steps, is at
               or below the target: 1.05 x sync's final training loss (same average)
    diverged   a non-finite loss (training, or the final evaluation), or the final
               training loss above the first step's
    tokens/s   SIMULATED, not measured: the simulator's per-step time with emulated costs
               (5, 5, 3 ms per layer for F, B, W; one layer per stage), the asynchronous
               steady state for asynchronous steps (no flush bubble), 1F1B's step with its
               flush for synchronous ones (sync, and the warm-up of +W); modes whose
               backward recomputes the forward (naive, pipemare, nesterov: they keep no old
               weights) pay one more forward per backward; pipedream and sync do not

Progress goes to stderr. The default size takes about 6 CPU-minutes (one core, torch on one thread).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from pipeblocks.core import Costs, WeightVersions, simulate, simulate_program, steady_state, weight_versions
from pipeblocks.data import TokenWindows
from pipeblocks.models import GPTConfig, build_stages, cross_entropy
from pipeblocks.schedules import get
from pipeblocks.schedules.asynchronous import async_1f1b
from pipeblocks.core.lowering.async_mode import DEFAULT_LR_WARMUP_FRACTION, AsyncMode
from pipeblocks.train.asynchronous.reference import replay
from pipeblocks.train.lr_schedule import resolve_schedule

from _output import write_json

EMULATED_MS = (5.0, 5.0, 3.0)
"""F, B, W per layer and microbatch (ms), the emulated costs of the tokens/s column"""
RECOMPUTING = ("naive", "pipemare", "nesterov")
TARGET_FACTOR = 1.05
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "pipemare.png")
MOMENTUM = 0.9
"""SGD's momentum"""
OPTIMIZERS = {"adam": "Adam", "sgd": f"SGD (momentum {MOMENTUM:g})"}
"""--optimizer choices and the names the table and the plot give them"""
DEFAULT_LRS = {"adam": (3e-3, 3e-2), "sgd": (0.03, 0.3)}
"""a normal and an aggressive base learning rate per optimizer, each picked once from a probe"""


def make_optimizer(name: str, lr: float):
    """A factory of the optimizer `name` at base rate `lr` over a stage's parameters."""
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    raise ValueError(f"optimizer {name!r}: choose one of {sorted(OPTIMIZERS)}")


@dataclass(frozen=True)
class Variant:
    label: str
    mode: str | None
    """None: synchronous 1F1B"""
    t1: bool = False
    t2: bool = False
    warmup: bool = False

    def async_mode(self, steps: int, k_share: float | None = None) -> AsyncMode:
        """k_share: T1's K as this share of the steps (None: the library's default, `default_k`)."""
        w = max(1, steps // 10) if self.warmup else 0
        if self.mode == "pipemare":
            k = None if k_share is None else max(1, int(steps * k_share))
            return AsyncMode("pipemare", sync_warmup_steps=w, lr_warmup_steps=k if self.t1 else 0,
                             discrepancy_decay=None if self.t2 else 1.0)
        return AsyncMode(self.mode or "naive", sync_warmup_steps=w)


VARIANTS = (
    Variant("sync", None),
    Variant("naive", "naive"),
    Variant("pipedream", "pipedream"),
    Variant("pipemare", "pipemare", t1=True, t2=True),
    Variant("pipemare-T1", "pipemare", t1=True),
    Variant("pipemare-T2", "pipemare", t2=True),
    Variant("pipemare+W", "pipemare", t1=True, t2=True, warmup=True),
    Variant("naive+W", "naive", warmup=True),
    Variant("nesterov", "nesterov"),
    Variant("nesterov+W", "nesterov", warmup=True),
)


@dataclass(frozen=True)
class Size:
    hidden: int
    heads: int
    seq: int
    microbatch: int
    steps: int
    eval_batches: int


DEFAULT = Size(hidden=64, heads=4, seq=32, microbatch=8, steps=300, eval_batches=8)
QUICK = Size(hidden=16, heads=2, seq=8, microbatch=2, steps=12, eval_batches=2)


def parse_config(text: str) -> tuple[int, int]:
    try:
        p, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"configuration {text!r}: write PxN, e.g. 8x1") from None
    if p < 2 or n < 1:
        raise argparse.ArgumentTypeError(f"configuration {text!r}: need p >= 2 stages and N >= 1 microbatches")
    return p, n


def step_times(p: int, n: int) -> dict[str, float]:
    """Simulated ms per optimizer step: 'sync' (1F1B with its flush), 'async' (steady state)
    and 'async-recompute' (the backward recomputes the forward)."""
    f, b, w = EMULATED_MS
    plain, recompute = Costs(t_f=f, t_b=b, t_w=w), Costs(t_f=f, t_b=b + f, t_w=w)
    steps = 4 + 2 * p // n
    return {
        "sync": simulate(get("1f1b")(p=p, m=n), plain).makespan,
        "async": steady_state(simulate_program(async_1f1b(p=p, n=n, steps=steps), plain)).step_time,
        "async-recompute": steady_state(simulate_program(async_1f1b(p=p, n=n, steps=steps), recompute)).step_time,
    }


def tokens_per_second(variant: Variant, steps: int, warmup: int, times: dict[str, float], tokens_per_step: int) -> float:
    if variant.mode is None:
        total_ms = steps * times["sync"]
    else:
        kind = "async-recompute" if variant.mode in RECOMPUTING else "async"
        total_ms = warmup * times["sync"] + (steps - warmup) * times[kind]
    return steps * tokens_per_step / (total_ms / 1000.0)


def smoothed(losses: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(losses):
        total += value
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


@torch.no_grad()
def evaluation_loss(stages, batches) -> float:
    total = 0.0
    for x, y in batches:
        for stage in stages:
            x = stage(x)
        total += float(cross_entropy(x, y))
    return total / len(batches)


def lr_factor(schedule: str, lr: float, steps: int):
    """The run's rate over its peak per step: None for a constant rate; 'default' is what
    `pipeblocks train` gives a fresh run (cosine to lr/10 after a warm-up of a tenth)."""
    if schedule == "constant":
        return None
    return resolve_schedule(None, lr=lr, warmup_steps=None, min_lr=None, steps=steps).factor


def train(variant: Variant, p: int, n: int, lr: float, size: Size, data: TokenWindows, evaluation,
          seed: int, optimizer: str = "adam", schedule: str = "constant", k_share: float | None = None) -> dict:
    cfg = GPTConfig(layers=p, hidden=size.hidden, heads=size.heads, seq=size.seq)
    stages = build_stages(cfg, seed=seed, num_stages=p, stages=range(p))
    mode = variant.async_mode(size.steps, k_share)
    async_steps = size.steps - mode.sync_warmup_steps
    if variant.mode is None:
        versions = WeightVersions.synchronous(p, n, size.steps)
    else:
        versions = weight_versions(async_1f1b(p=p, n=n, steps=async_steps))
    stream = [data.batch(i, size.microbatch, seed=2 * seed) for i in range(n * size.steps)]
    result = replay(stages, versions, stream, loss_fn=cross_entropy,
                    optimizer=make_optimizer(optimizer, lr), mode=mode, lr_factor=lr_factor(schedule, lr, size.steps))
    losses = list(result.losses)
    return {"losses": losses, "final": evaluation_loss(stages, evaluation), "warmup": mode.sync_warmup_steps}


def run_study(configs, lrs, size: Size, log=None, variants=VARIANTS, seed: int = 0,
              optimizer: str = "adam", schedule: str = "constant", k_share: float | None = None) -> list[dict]:
    torch.manual_seed(seed)
    data = TokenWindows.load(None, seq=size.seq)
    evaluation = [data.batch(i, size.microbatch, seed=2 * seed + 1) for i in range(size.eval_batches)]
    window = max(2, size.steps // 10)
    rows = []
    for p, n in configs:
        times = step_times(p, n)
        for lr in lrs:
            group = []
            for variant in variants:
                start = time.process_time()
                run = train(variant, p, n, lr, size, data, evaluation, seed, optimizer, schedule, k_share)
                if log:
                    log(f"p={p} N={n} lr={lr:g} {variant.label:<12} final {run['final']:.4f} "
                        f"({time.process_time() - start:.1f} s CPU)")
                losses = run["losses"]
                avg = smoothed(losses, window)
                group.append({
                    "p": p, "n": n, "optimizer": optimizer, "schedule": schedule, "lr": lr, "seed": seed,
                    "variant": variant.label, "final": run["final"],
                    "train_final": avg[-1], "first": losses[0], "losses": losses,
                    # a run can blow up in its last steps, past what the average of the training loss shows
                    "diverged": not all(math.isfinite(v) for v in losses) or not avg[-1] <= losses[0]
                    or not math.isfinite(run["final"]),
                    "tokens_per_s_simulated": tokens_per_second(
                        variant, size.steps, run["warmup"], times, n * size.microbatch * size.seq),
                    "_smoothed": avg,
                })
            sync = group[0]
            target = TARGET_FACTOR * sync["train_final"]
            for row in group:
                row["ratio"] = row["final"] / sync["final"]
                row["target"] = target
                row["steps_to_target"] = next((i + 1 for i, v in enumerate(row.pop("_smoothed")) if v <= target), None)
            rows.extend(group)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'p':>2} {'N':>2} {'lr':>7} {'seed':>4} {'variant':<12} {'final':>7} {'ratio':>6} {'to target':>9} "
          f"{'diverged':>8} {'tokens/s (sim)':>14}")
    for r in rows:
        target = "-" if r["steps_to_target"] is None else str(r["steps_to_target"])
        print(f"{r['p']:>2} {r['n']:>2} {r['lr']:>7g} {r['seed']:>4} {r['variant']:<12} {r['final']:>7.4f} "
              f"{r['ratio']:>6.3f} {target:>9} {'yes' if r['diverged'] else 'no':>8} "
              f"{r['tokens_per_s_simulated']:>14.0f}")


def print_summary(rows: list[dict]) -> None:
    """One line per variant: per (p, N, lr), sync's final loss or the variant's ratio, one per seed."""
    groups = list(dict.fromkeys((r["p"], r["n"], r["lr"]) for r in rows))
    seeds = list(dict.fromkeys(r["seed"] for r in rows))
    cell = {(r["p"], r["n"], r["lr"], r["seed"], r["variant"]): r for r in rows}
    print(f"\nsync: final loss; others: ratio to sync; seeds {' / '.join(map(str, seeds))}")
    print(f"{'variant':<12} " + " ".join(f"{f'p={p} N={n} lr={lr:g}':<26}" for p, n, lr in groups))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        key = "final" if variant == "sync" else "ratio"
        print(f"{variant:<12} " + " ".join(
            f"{' / '.join(f'{cell[(*g, s, variant)][key]:.3f}' for s in seeds):<26}" for g in groups))


def plot(rows: list[dict], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["p"], r["n"]) for r in rows})
    lrs = sorted({r["lr"] for r in rows})
    fig, axes = plt.subplots(len(configs), len(lrs), figsize=(5.5 * len(lrs), 4 * len(configs)), squeeze=False)
    for (i, (p, n)), (j, lr) in ((a, b) for a in enumerate(configs) for b in enumerate(lrs)):
        ax = axes[i][j]
        mine = [r for r in rows if (r["p"], r["n"], r["lr"]) == (p, n, lr)]
        lowest = math.inf
        for r in mine:
            # a diverged run's curve ends at its first non-finite loss: a running sum past a
            # huge or infinite value is meaningless
            losses = r["losses"]
            end = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses))
            curve = smoothed(losses[:end], max(2, len(losses) // 10))
            lowest = min(lowest, *curve) if curve else lowest
            solid = r["variant"] in ("sync", "naive", "pipedream", "pipemare", "nesterov")
            ax.plot(range(1, end + 1), curve, "-" if solid else ":",
                    label=r["variant"], linewidth=2.0 if r["variant"] == "sync" else 1.2,
                    color="black" if r["variant"] == "sync" else None)
        finite = [r["first"] for r in mine if math.isfinite(r["first"])]
        if finite and math.isfinite(lowest):
            ax.set_ylim(bottom=lowest * 0.98, top=max(finite) * 1.02)
        scheduled = "" if mine[0].get("schedule", "constant") == "constant" else " (warm-up, cosine)"
        ax.set_title(f"p={p}, N={n}, {OPTIMIZERS[mine[0]['optimizer']]} lr={lr:g}{scheduled}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss (moving average)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and 12 steps (seconds)")
    parser.add_argument("--configs", type=parse_config, nargs="+", default=None, metavar="PxN",
                        help="pipelines: p stages (one block each) x N microbatches per step (default 4x1 8x1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 300)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam",
                        help="adam, or sgd (momentum 0.9) (default adam)")
    parser.add_argument("--lrs", type=float, nargs="+", default=None,
                        help="base learning rates (default 0.003 0.03 for adam, 0.03 0.3 for sgd)")
    parser.add_argument("--lr-schedule", choices=("constant", "default"), default="constant",
                        help="constant, or the schedule `pipeblocks train` gives a fresh run: a warm-up of a "
                        "tenth, then cosine to lr/10 (default constant)")
    parser.add_argument("--k-share", type=float, default=None, metavar="F",
                        help="T1's K as this share of --steps (default: the library's, "
                        f"{DEFAULT_LR_WARMUP_FRACTION:g}; the first studies used steps/3: 0.3334)")
    parser.add_argument("--variants", nargs="+", choices=[v.label for v in VARIANTS[1:]], default=None,
                        help="run only these (sync, the reference, always runs; default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="model weights and data draws, one study per seed (default 0)")
    parser.add_argument("--plot", default=None, help=f"loss curves PNG (default {DEFAULT_PLOT}; 'none' for none)")
    parser.add_argument("--plot-seed", type=int, default=None, metavar="S",
                        help="the seed whose curves are drawn (one of --seeds; default the first)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout)")
    args = parser.parse_args(argv)
    size = QUICK if args.quick else DEFAULT
    if args.steps is not None:
        if args.steps < 10:
            parser.error(f"--steps must be >= 10 (a warm-up of steps/10 and a moving average), got {args.steps}")
        size = Size(**{**size.__dict__, "steps": args.steps})
    if any(seed < 0 for seed in args.seeds):
        parser.error(f"--seeds must be >= 0, got {args.seeds}")
    if args.plot_seed is not None and args.plot_seed not in args.seeds:
        parser.error(f"--plot-seed {args.plot_seed} is not one of --seeds {args.seeds}: add it to --seeds")
    if args.lrs is None:
        args.lrs = list(DEFAULT_LRS[args.optimizer])
    if any(not (lr > 0 and math.isfinite(lr)) for lr in args.lrs):
        parser.error(f"--lrs must be finite and > 0, got {args.lrs}")
    configs = args.configs or ([(2, 1), (3, 1)] if args.quick else [(4, 1), (8, 1)])
    torch.set_num_threads(1)
    variants = VARIANTS if args.variants is None else (VARIANTS[0], *(v for v in VARIANTS if v.label in args.variants))
    rows = [row for seed in args.seeds
            for row in run_study(configs, args.lrs, size, log=lambda text: print(text, file=sys.stderr, flush=True),
                                 variants=variants, seed=seed, optimizer=args.optimizer,
                                 schedule=args.lr_schedule, k_share=args.k_share)]
    print(f"model: GPT, one block per stage, hidden {size.hidden}, seq {size.seq}, microbatch {size.microbatch}, "
          f"{size.steps} steps, {OPTIMIZERS[args.optimizer]}, {args.lr_schedule} rate schedule; tokens/s simulated with "
          f"{EMULATED_MS} ms per layer (F, B, W)")
    print_table(rows)
    if len(args.seeds) > 1:
        print_summary(rows)
    path = DEFAULT_PLOT if args.plot is None else args.plot
    if path != "none":
        seed = args.seeds[0] if args.plot_seed is None else args.plot_seed
        print(f"loss curves (seed {seed}): {plot([r for r in rows if r['seed'] == seed], path)}")
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
