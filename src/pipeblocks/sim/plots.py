"""Plots: a timeline per rank (coloured by pass kind, microbatches labelled, as in the
papers' figures), memory over time, and memory against bubble across schedules. With
data-parallel ops, each rank's communication stream is drawn as a thin row under its
compute row (gathers, gradient reductions, the parameter gather after the step).

The file suffix picks the format (.png or .svg). matplotlib is imported here only, with
the non-interactive Agg backend, so the rest of the simulator never needs it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..core.actions import Kind
from ..core.errors import ScheduleError
from ..core.program import OptimizerStep
from ..core.timeline import Timeline

__all__ = ["plot_timeline", "plot_pareto", "ParetoPoint", "KIND_COLOURS", "DP_COLOURS"]

# Paper-like palette: forward blue, input-grad teal/green, weight-grad orange, fused purple.
KIND_COLOURS = {Kind.F: "#4C72B0", Kind.B: "#55A868", Kind.W: "#DD8452", Kind.BW: "#8172B3"}
_SUFFIXES = (".png", ".svg", ".pdf")
# Communication stream: parameter gather grey, gradient reduction red, gather after the step brown.
DP_COLOURS = {"UNSHARD": "#8C8C8C", "REDUCE_GRAD": "#C44E52", "OPTIMIZER_GATHER": "#937860"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _check_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.suffix.lower() not in _SUFFIXES:
        raise ScheduleError(f"plot file {str(path)!r}: use a {', '.join(_SUFFIXES)} suffix to choose the format")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plot_timeline(
    timeline: Timeline,
    path: str | os.PathLike,
    *,
    title: str | None = None,
    memory: bool = True,
    compare: Timeline | None = None,
    compare_label: str = "simulated",
) -> Path:
    """Draw the timeline (and, with `memory`, activation memory over time) to `path`.

    `compare`: a second timeline drawn above the first on the same time axis, e.g. the
    simulated schedule above the measured run.
    """
    plt = _pyplot()
    path = _check_path(path)
    panels = [(compare, compare_label)] if compare is not None else []
    panels.append((timeline, title or _default_title(timeline)))
    rows = len(panels) + (1 if memory else 0)
    p = timeline.schedule.p
    fig, axes = plt.subplots(
        rows, 1, figsize=(max(8.0, min(24.0, 0.45 * _slots(timeline))), 0.55 * p * len(panels) + 2.6 * memory + 0.8),
        squeeze=False, gridspec_kw={"height_ratios": [p] * len(panels) + ([max(2, p * 0.8)] if memory else [])},
    )
    for ax, (tl, label) in zip(axes[:, 0], panels):
        _draw_ranks(ax, tl, label)
    if memory:
        ax = axes[-1, 0]
        for r, trace in enumerate(timeline.memory):
            times = [t - timeline.start for t, _ in trace] + [timeline.makespan]
            values = [v for _, v in trace] + [trace[-1][1]]
            ax.step(times, values, where="post", label=f"rank {r}", linewidth=1.2)
        ax.set_xlim(0, timeline.makespan)
        ax.set_xlabel("time")
        ax.set_ylabel("activation")
        ax.set_title("activation memory over time", fontsize=9)
        if p <= 16:
            ax.legend(fontsize=7, ncol=min(p, 8), loc="upper right")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOURS.values()]
    labels = ["F", "B (input grad)", "W (weight grad)", "BW (fused)"]
    if any(tl.comm_events for tl, _ in panels):
        handles += [plt.Rectangle((0, 0), 1, 1, color=c) for c in DP_COLOURS.values()]
        labels += ["UNSHARD", "REDUCE_GRAD", "param gather after step"]
    fig.legend(handles, labels, loc="upper right", ncol=min(len(labels), 7), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def _default_title(timeline: Timeline) -> str:
    s = timeline.schedule
    dp = f"   exposed DP comm (max rank) {max(timeline.exposed_comm):.3g}" if timeline.exposed_comm else ""
    return (
        f"{s.name}  p={s.p} m={s.m} v={s.v}   bubble {timeline.bubble_ratio:.3f}   "
        f"peak {max(timeline.peak_activation):.3g}{dp}"
    )


def _slots(timeline: Timeline) -> float:
    shortest = min((e.end - e.start for evs in timeline.events for e in evs if e.end > e.start), default=1.0)
    return timeline.makespan / shortest


def _draw_ranks(ax, timeline: Timeline, title: str) -> None:
    schedule = timeline.schedule
    local_chunk = {s: i for r in range(schedule.p) for i, s in enumerate(schedule.placement.stages_of(r))}
    origin = timeline.start
    # with a communication stream, compute takes the upper part of the rank's row
    top, height = (-0.42, 0.56) if timeline.comm_events else (-0.4, 0.8)
    for r, comm in enumerate(timeline.comm_events):
        for e in comm:
            kind = e.op.lstrip("0123456789")
            ax.broken_barh([(e.start - origin, e.end - e.start)], (r + 0.18, 0.24),
                           facecolors=DP_COLOURS.get(kind, "#333333"), edgecolor="white", linewidth=0.4)
    for r, events in enumerate(timeline.events):
        for e in events:
            a = e.action
            if type(a) is OptimizerStep:  # asynchronous programs: a black bar where the weights change
                if e.end > e.start:
                    ax.broken_barh([(e.start - origin, e.end - e.start)], (r - 0.4, 0.8), facecolors="black")
                ax.vlines(e.start - origin, r - 0.45, r + 0.45, colors="black", linewidth=1.5)
                continue
            chunk = local_chunk[a.stage]
            ax.broken_barh(
                [(e.start - origin, e.end - e.start)], (r + top, height),
                facecolors=KIND_COLOURS[a.kind], edgecolor="white", linewidth=0.6,
                hatch="//" if chunk % 2 else None, alpha=1.0 if chunk % 2 == 0 else 0.8,
            )
            text = str(a.microbatch) if a.seq_chunk is None else f"{a.microbatch}.{a.seq_chunk}"
            ax.text(e.start - origin + (e.end - e.start) / 2, r + top + height / 2, text,
                    ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(schedule.p))
    ax.set_yticklabels([f"rank {r}" for r in range(schedule.p)], fontsize=7)
    ax.set_ylim(schedule.p - 0.5, -0.5)
    ax.set_xlim(0, max(timeline.makespan, 1e-9))
    ax.set_title(title, fontsize=9)


@dataclass(frozen=True)
class ParetoPoint:
    """One schedule on the memory-versus-bubble picture."""

    label: str
    peak_activation: float
    bubble_ratio: float
    series: str = ""


def plot_pareto(points: Sequence[ParetoPoint], path: str | os.PathLike, *, title: str = "") -> Path:
    """Scatter of peak activation (x) against bubble ratio (y); points sharing a `series`
    are joined by a line (for example, v-adaptive over memory limits)."""
    plt = _pyplot()
    path = _check_path(path)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    series: dict[str, list[ParetoPoint]] = {}
    spots: dict[tuple[float, float], list[str]] = {}  # schedules that land on one spot share a label
    for point in points:
        if point.series:
            series.setdefault(point.series, []).append(point)
        else:
            spot = (round(point.peak_activation, 9), round(point.bubble_ratio, 9))
            spots.setdefault(spot, []).append(point.label)
    for (x, y), labels in spots.items():
        ax.scatter([x], [y], s=40, zorder=3)
        ax.annotate(", ".join(labels), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for name, pts in series.items():
        pts = sorted(pts, key=lambda q: q.peak_activation)
        ax.plot([q.peak_activation for q in pts], [q.bubble_ratio for q in pts], marker=".", label=name)
    if series:
        ax.legend(fontsize=8)
    ax.set_xlabel("peak activation per rank (1F1B = p)")
    ax.set_ylabel("bubble ratio")
    ax.set_title(title or "memory against bubble", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
