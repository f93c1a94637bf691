"""Plots: units on the axes, one time scale for compared timelines, the chunk hatching in
the legend, and rank colours that stay apart beyond ten ranks."""
from __future__ import annotations

import pytest
from matplotlib.colors import to_rgb

from pipeblocks import Costs, ScheduleError, schedules, simulate
from pipeblocks.sim.analytic import HARDWARE, MODELS, transformer_costs
from pipeblocks.sim.plots import ParetoPoint, plot_pareto, rank_colours, timeline_figure


@pytest.fixture
def figures():
    import matplotlib.pyplot as plt

    made = []
    yield made
    for fig in made:
        plt.close(fig)


def _figure(figures, timeline, **options):
    fig = timeline_figure(timeline, **options)
    figures.append(fig)
    return fig


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_axes_name_their_units(figures):
    unit = simulate(schedules.get("1f1b")(p=2, m=4))
    fig = _figure(figures, unit)
    assert fig.axes[-1].get_xlabel() == "time (cost units)"
    assert "1 = one microbatch" in fig.axes[-1].get_ylabel()

    schedule = schedules.get("1f1b")(p=4, m=8)
    costs = transformer_costs(MODELS["1.5b"], HARDWARE["a100"], num_stages=schedule.num_stages)
    real = simulate(schedule, costs)
    fig = _figure(figures, real, time_unit="s", memory_unit="bytes")
    assert fig.axes[-1].get_xlabel() in ("time (ms)", "time (s)")
    assert fig.axes[-1].get_ylabel() == "activation (GiB)"
    assert "GiB" in fig.axes[0].get_title()  # the peak in the title, in the axis unit


def test_compared_timelines_share_one_time_scale(figures):
    schedule = schedules.get("1f1b")(p=2, m=4)
    fast = simulate(schedule)
    slow = simulate(schedule, Costs(t_f=3, t_b=3, t_w=3))
    fig = _figure(figures, fast, compare=slow)
    top, bottom = fig.axes[0], fig.axes[1]
    assert top.get_xlim() == bottom.get_xlim()
    assert top.get_xlim()[1] == pytest.approx(slow.makespan)  # the longer run sets the scale


def test_legend_explains_the_chunk_hatching(figures):
    looped = simulate(schedules.get("interleaved-1f1b")(p=2, m=4))
    assert "2nd chunk (hatched)" in _legend_texts(_figure(figures, looped))
    plain = simulate(schedules.get("1f1b")(p=2, m=4))
    assert not any("hatched" in text for text in _legend_texts(_figure(figures, plain)))


@pytest.mark.parametrize("n", [4, 10, 11, 16, 20, 24, 32])
def test_rank_colours_are_distinct(n):
    colours = [to_rgb(c) for c in rank_colours(n)]
    assert len(set(colours)) == n


def test_memory_lines_use_distinct_colours_beyond_ten_ranks(figures):
    fig = _figure(figures, simulate(schedules.get("1f1b")(p=12, m=12)))
    lines = fig.axes[-1].get_lines()
    assert len({to_rgb(line.get_color()) for line in lines}) == 12


def test_units_are_checked(tmp_path):
    t = simulate(schedules.get("1f1b")(p=2, m=2))
    with pytest.raises(ScheduleError, match="time_unit"):
        timeline_figure(t, time_unit="hours")
    with pytest.raises(ScheduleError, match="memory_unit"):
        plot_pareto([ParetoPoint("a", 1, 0.1)], tmp_path / "p.png", memory_unit="pages")
