"""`pipeblocks plan --plot FILE`: MFU against peak memory per GPU, one point per feasible
configuration, coloured by schedule, the best of each schedule ringed and labelled."""
from __future__ import annotations

import os
from pathlib import Path

from ..sim.plots import plot_file, pyplot, rank_colours
from .search import PlanResult

__all__ = ["plot_plan"]


def plot_plan(result: PlanResult, path: str | os.PathLike) -> Path:
    path = plot_file(path)
    plt = pyplot()
    ranked = result.ranked
    labels = sorted({e.candidate.label for e in ranked})
    colours = dict(zip(labels, rank_colours(max(len(labels), 1))))
    fig, ax = plt.subplots(figsize=(8, 5))
    for label in labels:
        points = [e for e in ranked if e.candidate.label == label]
        ax.scatter([e.peak_memory / 1e9 for e in points], [e.mfu * 100 for e in points], s=14, alpha=0.6,
                   color=colours[label], label=label)
    labelled: dict[tuple[float, float], int] = {}
    for label, e in result.best_per_schedule.items():
        c = e.candidate
        x, y = e.peak_memory / 1e9, e.mfu * 100
        ax.scatter([x], [y], s=90, facecolors="none", edgecolors=colours[label], linewidths=2)
        # schedules that tie on the same point get their labels stacked, not overprinted
        spot = (round(x, 1), round(y, 2))
        below = labelled.get(spot, 0)
        labelled[spot] = below + 1
        ax.annotate(f"{label} dp{c.dp} tp{c.tp} pp{c.pp} mb{c.microbatch_size}", (x, y), fontsize=7,
                    xytext=(4, 4 - 9 * below), textcoords="offset points")
    ax.axvline(result.problem.gpu_memory / 1e9, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("peak memory per GPU (GB: static + activation, worst rank)")
    ax.set_ylabel("MFU (%)")
    p = result.problem
    ax.set_title(f"{p.gpus} GPUs, seq {p.model.seq}, batch {p.global_batch}: feasible configurations")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
