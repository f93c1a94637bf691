"""PipeMare with the defaults users get: `pipeblocks train --async MODE` against synchronous
training at the same settings, each run as the command line resolves it.

    python benchmarks/pipemare_defaults.py [--setups train small] [--seeds 0 1 2 3 4]
                                           [--variants naive pipemare ...] [--extra 'LABEL=OPTIONS' ...]
                                           [--json FILE] [--plot PATH]

A setup is a command line a user types; a variant adds options to it. Every run is built
by `pipeblocks train`'s own option parsing and `prepare` (`cli.train.prepare_from_args`:
model, data, held-out split, learning rate, schedule and the mode's K, D and W resolved
exactly as a run resolves them) and trained by the one-process replay of that run
(`train.asynchronous.run.replay_run`), which `train --async --verify` holds the ranks to:
these are the losses the multi-process run computes, without starting p processes.

Setups:
    train   `-p 4`: the default model (GPT, 8 layers, hidden 64, seq 64), m = 4, 40 steps
    small   `-p 4 -m 2 --layers 4 --steps 80`: 4 layers, hidden 64, N = 2
    long    `-p 4 -m 2 --layers 4 --steps 300`: the same for longer

Variants: sync (`--schedule 1f1b`, no --async), naive, pipemare (the defaults), pipemare-T1
(`--discrepancy-decay 1`: T1 alone), pipemare-T2 (`--lr-warmup-steps 0`: T2 alone),
pipemare+W (`--sync-warmup-steps` a tenth of the steps), pipedream, nesterov; `--extra
'LABEL=OPTIONS'` adds one (options appended to the setup's, e.g. 'K5=--async pipemare
--lr-warmup-steps 5').

Columns: final = mean of the run's last 10 training losses (each step's mean loss, as its
forwards saw it); mean and sample standard deviation over the seeds; ratio = the variant's
mean final over sync's; per-seed ratios, smallest to largest. About 2 s per run of the
small setup and 4 s of train (one core).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass

import torch

from pipeblocks.cli.main import build_parser
from pipeblocks.cli.train import prepare_from_args
from pipeblocks.train.asynchronous.run import replay_run

from _output import write_json

SETUPS = {
    "train": "-p 4",
    "small": "-p 4 -m 2 --layers 4 --steps 80",
    "long": "-p 4 -m 2 --layers 4 --steps 300",
}
DEFAULT_SETUPS = ("train", "small")
LAST = 10
"""the final loss is the mean of this many last training losses"""
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "pipemare-defaults.png")


@dataclass(frozen=True)
class Variant:
    label: str
    options: str
    """appended to the setup's command line"""
    warmup_share: float = 0.0
    """--sync-warmup-steps as this share of the run's --steps (0: none)"""

    def argv(self, setup: str, seed: int) -> list[str]:
        argv = [*SETUPS[setup].split(), *self.options.split(), "--seed", str(seed), "--quiet", "--device", "cpu"]
        if self.warmup_share:
            argv += ["--sync-warmup-steps", str(max(1, int(steps_of(argv) * self.warmup_share)))]
        return argv


VARIANTS = (
    Variant("sync", "--schedule 1f1b"),
    Variant("naive", "--async naive"),
    Variant("pipemare", "--async pipemare"),
    Variant("pipemare-T1", "--async pipemare --discrepancy-decay 1"),
    Variant("pipemare-T2", "--async pipemare --lr-warmup-steps 0"),
    Variant("pipemare+W", "--async pipemare", warmup_share=0.1),
    Variant("pipedream", "--async pipedream"),
    Variant("nesterov", "--async nesterov"),
)


def steps_of(argv: list[str]) -> int:
    """--steps of a train command line (its default when absent)."""
    return build_parser().parse_args(["train", *argv]).steps


def parse_extra(text: str) -> Variant:
    label, sep, options = text.partition("=")
    if not sep or not label or not options.strip():
        raise argparse.ArgumentTypeError(f"--extra {text!r}: write LABEL=OPTIONS, e.g. 'K5=--async pipemare "
                                         "--lr-warmup-steps 5'")
    return Variant(label.strip(), options.strip())


def run_one(argv: list[str]) -> list[float]:
    """The per-step training losses of `pipeblocks train ARGV`, replayed in this process."""
    cfg, data = prepare_from_args(build_parser().parse_args(["train", *argv]))
    result, _ = replay_run(cfg, data)
    return list(result.losses)


def final_loss(losses: list[float]) -> float:
    return sum(losses[-LAST:]) / len(losses[-LAST:])


def study(setups, variants, seeds, log=None) -> list[dict]:
    rows = []
    for setup in setups:
        for variant in variants:
            for seed in seeds:
                argv = variant.argv(setup, seed)
                losses = run_one(argv)
                rows.append({"setup": setup, "variant": variant.label, "seed": seed, "argv": argv,
                             "final": final_loss(losses), "losses": losses})
                if log:
                    log(f"{setup} {variant.label} seed {seed}: {rows[-1]['final']:.4f}")
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per (setup, variant): mean and spread of the final loss over seeds, ratios to sync."""
    out = []
    sync = {(r["setup"], r["seed"]): r["final"] for r in rows if r["variant"] == "sync"}
    for setup in dict.fromkeys(r["setup"] for r in rows):
        sync_mean = statistics.mean(v for (s, _), v in sync.items() if s == setup) if sync else None
        for variant in dict.fromkeys(r["variant"] for r in rows if r["setup"] == setup):
            mine = [r for r in rows if (r["setup"], r["variant"]) == (setup, variant)]
            finals = [r["final"] for r in mine]
            ratios = sorted(r["final"] / sync[(setup, r["seed"])] for r in mine if (setup, r["seed"]) in sync)
            out.append({"setup": setup, "variant": variant, "seeds": len(finals), "mean": statistics.mean(finals),
                        "sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                        "ratio": statistics.mean(finals) / sync_mean if sync_mean else None,
                        "seed_ratios": ratios})
    return out


def print_summary(table: list[dict]) -> None:
    print(f"final = mean of the last {LAST} training losses; mean ± sd over seeds; ratio = mean / sync's mean")
    print(f"{'setup':<6} {'variant':<14} {'seeds':>5} {'final':>16} {'ratio':>6}  per-seed ratios")
    for row in table:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        seeds = " ".join(f"{v:.3f}" for v in row["seed_ratios"])
        print(f"{row['setup']:<6} {row['variant']:<14} {row['seeds']:>5} {row['mean']:>8.4f} ± {row['sd']:.4f} "
              f"{ratio:>6}  {seeds}")


def plot(rows: list[dict], path: str) -> str:
    """Per setup, every variant's training loss averaged over the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(dict.fromkeys(r["setup"] for r in rows))
    fig, axes = plt.subplots(1, len(setups), figsize=(6 * len(setups), 4), squeeze=False)
    for ax, setup in zip(axes[0], setups):
        for variant in dict.fromkeys(r["variant"] for r in rows if r["setup"] == setup):
            curves = [r["losses"] for r in rows if (r["setup"], r["variant"]) == (setup, variant)]
            mean = [statistics.mean(values) for values in zip(*curves)]
            ax.plot(range(1, len(mean) + 1), mean, label=variant, color="black" if variant == "sync" else None,
                    linewidth=2.0 if variant == "sync" else 1.2)
        ax.set_title(f"{setup}: pipeblocks train {SETUPS[setup]}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"training loss (mean of {len(curves)} seeds)")
        ax.set_ylim(top=4.5)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", choices=sorted(SETUPS), default=list(DEFAULT_SETUPS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--variants", nargs="+", choices=[v.label for v in VARIANTS[1:]], default=None,
                        help="run only these (sync, the reference, always runs; default: all)")
    parser.add_argument("--extra", type=parse_extra, nargs="+", default=[], metavar="LABEL=OPTIONS",
                        help="more variants: options appended to the setup's command line")
    parser.add_argument("--plot", default="none", help=f"mean loss curves PNG ('default': {DEFAULT_PLOT})")
    parser.add_argument("--json", metavar="FILE", help="also write every run's losses as JSON ('-' for stdout)")
    args = parser.parse_args(argv)
    if any(seed < 0 for seed in args.seeds):
        parser.error(f"--seeds must be >= 0, got {args.seeds}")
    chosen = VARIANTS if args.variants is None else (VARIANTS[0], *(v for v in VARIANTS if v.label in args.variants))
    torch.set_num_threads(1)
    rows = study(args.setups, (*chosen, *args.extra), args.seeds,
                 log=lambda text: print(text, file=sys.stderr, flush=True))
    table = summary(rows)
    print_summary(table)
    if args.plot != "none":
        print(f"loss curves: {plot(rows, DEFAULT_PLOT if args.plot == 'default' else args.plot)}")
    if args.json:
        write_json({"runs": rows, "summary": table}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
