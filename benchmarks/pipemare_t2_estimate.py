"""How well PipeMare's T2 estimate recovers the forward's weights, on a noisy quadratic.

    python benchmarks/pipemare_t2_estimate.py [--p 4] [--n 1] [--steps 60] [--decay 0.1 0.5 0.9 1] [--json FILE]

The model is p stages y = x + w_s (a quadratic in all weights under a squared loss), the
inputs are noise around a fixed target, and the delays are those of asynchronous 1F1B
with N microbatches per step. The one-process replay (`pipeblocks.train.asynchronous.reference`)
runs mode pipemare without T1 (K = 0) and measures, at every delayed backward after the
first quarter of the run,

    |w - tau*delta - w_F| / |w - w_F|

the distance of T2's estimate from the weights the forward used, relative to that of the
current weights (1 = no better than no correction; D = 1 is no correction), averaged per
delay. Lower is better. A stage y = x + w has gradients that do not depend on its weights,
so the trajectory (and the final loss) is the same for every D: the rows compare
estimators on one trajectory, not the training they would lead to.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from pipeblocks.core import weight_versions
from pipeblocks.schedules.asynchronous import async_1f1b
from pipeblocks.core.lowering.async_mode import AsyncMode
from pipeblocks.train.asynchronous.reference import replay

from _output import write_json

OPTIMIZERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.005, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.02),
}


class Shift(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def forward(self, x):
        return x + self.w


def half_square(out, target):
    return 0.5 * ((out - target) ** 2).sum()


def measure(p: int, n: int, steps: int, decay: float, optimizer: str, dim: int = 50, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    start = torch.randn(p, dim, generator=gen, dtype=torch.float64)
    target = torch.randn(dim, generator=gen, dtype=torch.float64)
    stream = [(0.3 * torch.randn(dim, generator=gen, dtype=torch.float64), target) for _ in range(n * steps)]
    versions = weight_versions(async_1f1b(p=p, n=n, steps=steps))
    result = replay([Shift(w) for w in start], versions, stream, loss_fn=half_square,
                    optimizer=OPTIMIZERS[optimizer], mode=AsyncMode("pipemare", lr_warmup_steps=0,
                                                                    discrepancy_decay=decay),
                    measure_discrepancy=True)
    ratios: dict[int, list[float]] = {}
    for d in result.discrepancies:
        if d.step >= steps // 4 and d.uncorrected > 0:
            ratios.setdefault(d.delay, []).append(d.used / d.uncorrected)
    return {
        "p": p, "n": n, "steps": steps, "optimizer": optimizer, "decay": decay,
        "ratio_by_delay": {tau: sum(v) / len(v) for tau, v in sorted(ratios.items())},
        "final_loss": result.losses[-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--decay", type=float, nargs="+", default=[0.1, 0.5, 0.9, 1.0])
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(args.p, args.n, args.steps, d, opt) for opt in OPTIMIZERS for d in args.decay]
    delays = sorted({tau for r in rows for tau in r["ratio_by_delay"]})
    print(f"p={args.p} N={args.n} steps={args.steps}: |estimate - w_F| / |w - w_F| per delay (1 = no gain)")
    print(f"{'optimizer':<13} {'D':>4} " + " ".join(f"{'tau=' + str(t):>7}" for t in delays) + f" {'final loss':>11}")
    for r in rows:
        cells = " ".join(f"{r['ratio_by_delay'].get(t, float('nan')):>7.3f}" for t in delays)
        print(f"{r['optimizer']:<13} {r['decay']:>4g} {cells} {r['final_loss']:>11.4g}")
    if args.json:
        write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
