"""Plots: a timeline per rank (coloured by pass kind, microbatches labelled, as in the
papers' figures), memory over time, and memory against bubble across schedules. With
data-parallel ops, each rank's communication stream is drawn as a thin row under its
compute row (gathers, gradient reductions, the parameter gather after the step).

The file suffix picks the format (.png or .svg). matplotlib is imported here only, with
the non-interactive Agg backend, so the rest of the simulator never needs it.

Axes carry units: the simulator's cost units and the unit memory model by default, or
seconds and bytes (`time_unit="s"`, `memory_unit="bytes"`: analytic or profiled costs, a
measured run), drawn in ms/s and KiB/MiB/GiB as the figures' size suggests.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..core.ir.actions import Kind
from ..core.ir.errors import ScheduleError
from ..core.ir.ops import OptimizerStep, Recompute
from ..core.simulator.timeline import Timeline
from ..core.ir.vocab import VocabPass

__all__ = [
    "plot_timeline", "plot_pareto", "ParetoPoint", "KIND_COLOURS", "DP_COLOURS", "check_plot_suffix", "rank_colours",
    "timeline_figure", "plot_file", "pyplot",
]

# Paper-like palette: forward blue, input-grad teal/green, weight-grad orange, fused purple.
KIND_COLOURS = {Kind.F: "#4C72B0", Kind.B: "#55A868", Kind.W: "#DD8452", Kind.BW: "#8172B3"}
_SUFFIXES = (".png", ".svg", ".pdf")
# Communication stream: parameter gather grey, gradient reduction red, gather after the step brown.
# A recomputation (RECOMPUTE): a forward run again, in a lighter blue.
RECOMPUTE_COLOUR = "#9DB4D8"
VOCAB_COLOUR = "#7F7F7F"  # vocabulary passes (IF, S, T, IB), run on every rank
DP_COLOURS = {"UNSHARD": "#8C8C8C", "REDUCE_GRAD": "#C44E52", "OPTIMIZER_GATHER": "#937860"}
TIME_UNITS = ("units", "s")
MEMORY_UNITS = ("units", "bytes")


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend."""
    import matplotlib  # optional: only plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_plot_suffix(path: str | os.PathLike) -> Path:
    """`path` as a Path; an error unless its suffix names a format we write."""
    path = Path(path)
    if path.suffix.lower() not in _SUFFIXES:
        raise ScheduleError(f"plot file {str(path)!r}: use a {', '.join(_SUFFIXES)} suffix to choose the format")
    return path


def plot_file(path: str | os.PathLike) -> Path:
    """`check_plot_suffix`'s Path, its folder made."""
    path = check_plot_suffix(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plot_timeline(timeline: Timeline, path: str | os.PathLike, **options) -> Path:
    """Draw the timeline (and, with `memory`, activation memory over time) to `path`; the
    options are `timeline_figure`'s."""
    path = plot_file(path)
    fig = timeline_figure(timeline, **options)
    fig.savefig(path, dpi=130)
    pyplot().close(fig)
    return path


def timeline_figure(
    timeline: Timeline,
    *,
    title: str | None = None,
    memory: bool = True,
    compare: Timeline | None = None,
    compare_label: str = "simulated",
    time_unit: str = "units",
    memory_unit: str = "units",
):
    """The matplotlib Figure of `plot_timeline` (the caller saves and closes it).

    `compare`: a second timeline drawn above the first on the same time axis, e.g. the
    simulated schedule above the measured run.
    `time_unit`: "units" (the cost model's) or "s"; `memory_unit`: "units" (1 = one
    microbatch's activation of one full stage) or "bytes".
    """
    _check_units(time_unit, memory_unit)
    plt = pyplot()
    panels = [(compare, compare_label)] if compare is not None else []
    panels.append((timeline, title or _default_title(timeline, memory_unit)))
    rows = len(panels) + (1 if memory else 0)
    p = timeline.schedule.p
    # one time scale for every panel, so a simulated and a measured run compare by eye
    span = max(max(tl.makespan for tl, _ in panels), 1e-12)
    t_scale, t_label = _time_axis(span, time_unit)
    fig, axes = plt.subplots(
        rows, 1, figsize=(max(8.0, min(24.0, 0.45 * _slots(timeline))), 0.55 * p * len(panels) + 2.6 * memory + 0.8),
        squeeze=False, sharex=True,
        gridspec_kw={"height_ratios": [p] * len(panels) + ([max(2, p * 0.8)] if memory else [])},
    )
    for ax, (tl, label) in zip(axes[:, 0], panels):
        _draw_ranks(ax, tl, label, t_scale)
    colours = rank_colours(p)
    if memory:
        ax = axes[-1, 0]
        peak = max((v for trace in timeline.memory for _, v in trace), default=0.0)
        m_scale, m_label = _memory_axis(peak, memory_unit)
        for r, trace in enumerate(timeline.memory):
            times = [(t - timeline.start) / t_scale for t, _ in trace] + [timeline.makespan / t_scale]
            values = [v / m_scale for _, v in trace] + [trace[-1][1] / m_scale]
            ax.step(times, values, where="post", label=f"rank {r}", linewidth=1.2, color=colours[r])
        ax.set_ylabel(m_label, fontsize=8)
        ax.set_title("activation memory over time", fontsize=9)
        if p <= 16:
            ax.legend(fontsize=7, ncol=min(p, 8), loc="upper right")
    axes[-1, 0].set_xlim(0, span / t_scale)
    axes[-1, 0].set_xlabel(t_label)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KIND_COLOURS.values()]
    labels = ["F", "B (input grad)", "W (weight grad)", "BW (fused)"]
    most = max(tl.schedule.v for tl, _ in panels)
    if most > 1:
        handles += [plt.Rectangle((0, 0), 1, 1, facecolor="#999999", edgecolor="white"),
                    plt.Rectangle((0, 0), 1, 1, facecolor="#999999", edgecolor="white", hatch="//", alpha=0.8)]
        labels += (["1st chunk on a rank", "2nd chunk (hatched)"] if most == 2
                   else ["even chunks on a rank", "odd chunks (hatched)"])
    if any(type(e.action) is Recompute for tl, _ in panels for evs in tl.events for e in evs):
        handles.append(plt.Rectangle((0, 0), 1, 1, color=RECOMPUTE_COLOUR))
        labels.append("R (recompute)")
    if any(tl.comm_events for tl, _ in panels):
        handles += [plt.Rectangle((0, 0), 1, 1, color=c) for c in DP_COLOURS.values()]
        labels += ["UNSHARD", "REDUCE_GRAD", "param gather after step"]
    fig.legend(handles, labels, loc="upper right", ncol=min(len(labels), 7), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    return fig


def rank_colours(n: int) -> list:
    """n colours that stay apart: matplotlib's ten-colour cycle, then tab20, then evenly
    spaced hues of a perceptual map (beyond 20 ranks no palette keeps every pair apart, but
    neighbours differ)."""
    import matplotlib  # optional: only plots need it

    if n <= 10:
        return [matplotlib.colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        tab20 = matplotlib.colormaps["tab20"]
        return [tab20(2 * i) for i in range(10)] + [tab20(2 * i + 1) for i in range(n - 10)]
    turbo = matplotlib.colormaps["turbo"]
    order = [i // 2 if i % 2 == 0 else (n + i) // 2 for i in range(n)]  # interleave so neighbours differ
    return [turbo(0.05 + 0.9 * k / (n - 1)) for k in order]


def _check_units(time_unit: str, memory_unit: str) -> None:
    if time_unit not in TIME_UNITS:
        raise ScheduleError(f"time_unit must be one of {TIME_UNITS}, got {time_unit!r}")
    if memory_unit not in MEMORY_UNITS:
        raise ScheduleError(f"memory_unit must be one of {MEMORY_UNITS}, got {memory_unit!r}")


def _time_axis(span: float, unit: str) -> tuple[float, str]:
    """(divisor, axis label) for times up to `span`."""
    if unit == "units":
        return 1.0, "time (cost units)"
    return (1e-3, "time (ms)") if span < 2.0 else (1.0, "time (s)")


def _memory_axis(peak: float, unit: str) -> tuple[float, str]:
    """(divisor, axis label) for activation memory up to `peak`."""
    if unit == "units":
        return 1.0, "activation (1 = one microbatch\nthrough one stage)"
    for divisor, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if peak >= divisor:
            return float(divisor), f"activation ({name})"
    return 1.0, "activation (bytes)"


def _default_title(timeline: Timeline, memory_unit: str = "units") -> str:
    s = timeline.schedule
    dp = f"   exposed DP comm (max rank) {max(timeline.exposed_comm):.3g}" if timeline.exposed_comm else ""
    peak = max(timeline.peak_activation)
    scale, label = _memory_axis(peak, memory_unit)
    unit = "" if memory_unit == "units" else " " + label.split("(")[1].rstrip(")")
    return (
        f"{s.name}  p={s.p} m={s.m} v={s.v}   bubble {timeline.bubble_ratio:.3f}   "
        f"peak {peak / scale:.3g}{unit}{dp}"
    )


def _slots(timeline: Timeline) -> float:
    shortest = min((e.end - e.start for evs in timeline.events for e in evs if e.end > e.start), default=1.0)
    return timeline.makespan / shortest


def _draw_ranks(ax, timeline: Timeline, title: str, scale: float = 1.0) -> None:
    schedule = timeline.schedule
    local_chunk = {s: i for r in range(schedule.p) for i, s in enumerate(schedule.placement.stages_of(r))}
    origin = timeline.start
    # with a communication stream, compute takes the upper part of the rank's row
    top, height = (-0.42, 0.56) if timeline.comm_events else (-0.4, 0.8)
    for r, comm in enumerate(timeline.comm_events):
        for e in comm:
            kind = e.op.lstrip("0123456789").split(".")[0]  # 2UNSHARD.1: unit 1 of stage 2
            ax.broken_barh([((e.start - origin) / scale, (e.end - e.start) / scale)], (r + 0.18, 0.24),
                           facecolors=DP_COLOURS.get(kind, "#333333"), edgecolor="white", linewidth=0.4)
    for r, events in enumerate(timeline.events):
        for e in events:
            a = e.action
            if type(a) is OptimizerStep:  # asynchronous programs: a black bar where the weights change
                if e.end > e.start:
                    ax.broken_barh([((e.start - origin) / scale, (e.end - e.start) / scale)], (r - 0.4, 0.8),
                                   facecolors="black")
                ax.vlines((e.start - origin) / scale, r - 0.45, r + 0.45, colors="black", linewidth=1.5)
                continue
            if type(a) is VocabPass:  # vocabulary parallelism: a grey bar on every rank, labelled S5, T5, ...
                ax.broken_barh([((e.start - origin) / scale, (e.end - e.start) / scale)], (r + top, height),
                               facecolors=VOCAB_COLOUR, edgecolor="white", linewidth=0.6)
                ax.text((e.start - origin + (e.end - e.start) / 2) / scale, r + top + height / 2, str(a),
                        ha="center", va="center", fontsize=5, color="white")
                continue
            chunk = local_chunk[a.stage]
            ax.broken_barh(
                [((e.start - origin) / scale, (e.end - e.start) / scale)], (r + top, height),
                facecolors=RECOMPUTE_COLOUR if type(a) is Recompute else KIND_COLOURS[a.kind], edgecolor="white", linewidth=0.6,
                hatch="//" if chunk % 2 else None, alpha=1.0 if chunk % 2 == 0 else 0.8,
            )
            text = str(a.microbatch) if a.seq_chunk is None else f"{a.microbatch}.{a.seq_chunk}"
            ax.text((e.start - origin + (e.end - e.start) / 2) / scale, r + top + height / 2, text,
                    ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(schedule.p))
    ax.set_yticklabels([f"rank {r}" for r in range(schedule.p)], fontsize=7)
    ax.set_ylim(schedule.p - 0.5, -0.5)
    ax.set_title(title, fontsize=9)


@dataclass(frozen=True)
class ParetoPoint:
    """One schedule on the memory-versus-bubble picture."""

    label: str
    peak_activation: float
    bubble_ratio: float
    series: str = ""


def plot_pareto(
    points: Sequence[ParetoPoint], path: str | os.PathLike, *, title: str = "", memory_unit: str = "units",
) -> Path:
    """Scatter of peak activation (x) against bubble ratio (y); points sharing a `series`
    are joined by a line (for example, v-adaptive over memory limits). `memory_unit`:
    "units" (1F1B's peak is p) or "bytes" (analytic costs)."""
    _check_units("units", memory_unit)
    peak = max((q.peak_activation for q in points), default=0.0)
    scale, label = _memory_axis(peak, memory_unit)
    points = [ParetoPoint(q.label, q.peak_activation / scale, q.bubble_ratio, q.series) for q in points]
    plt = pyplot()
    path = plot_file(path)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    series: dict[str, list[ParetoPoint]] = {}
    spots: dict[tuple[float, float], list[str]] = {}  # schedules that land on one spot share a label
    for point in points:
        if point.series:
            series.setdefault(point.series, []).append(point)
        else:
            spot = (round(point.peak_activation, 9), round(point.bubble_ratio, 9))
            spots.setdefault(spot, []).append(point.label)
    for ((x, y), labels), colour in zip(spots.items(), rank_colours(len(spots))):
        ax.scatter([x], [y], s=40, zorder=3, color=colour)
        ax.annotate(", ".join(labels), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for name, pts in series.items():
        pts = sorted(pts, key=lambda q: q.peak_activation)
        ax.plot([q.peak_activation for q in pts], [q.bubble_ratio for q in pts], marker=".", label=name)
    if series:
        ax.legend(fontsize=8)
    ax.set_xlabel("peak activation per rank (1 = one microbatch through one stage; 1F1B = p)"
                  if memory_unit == "units" else f"peak {label.replace(chr(10), ' ')} per rank")
    ax.set_ylabel("bubble ratio")
    ax.set_title(title or "memory against bubble", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
