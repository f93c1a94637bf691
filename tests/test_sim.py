"""Cost model, memory model, analytic transformer costs, text timeline, plots."""
import pytest

from pipeblocks import Costs, Schedule, ScheduleError, schedules, simulate
from pipeblocks.sim.analytic import HARDWARE, MODELS, TransformerConfig, layer_split, parse_model, transformer_costs
from pipeblocks.core.cost.costs import parse_costs
from pipeblocks.sim.plots import ParetoPoint, plot_pareto, plot_timeline
from pipeblocks.sim.text_timeline import render_text_timeline

approx = pytest.approx


def one_rank(text: str) -> Schedule:
    return Schedule.from_text("0: " + text + "\n")


def trace_values(timeline):
    return [v for _, v in timeline.memory[0]]


def test_memory_model_split_backward_default_keeps_all_until_w():
    t = simulate(one_rank("0F0 0F1 0B0 0W0 0B1 0W1"))
    assert trace_values(t) == [0, 1, 2, 1, 0]  # B frees nothing; each W frees its microbatch
    assert t.peak_activation == (2,)


def test_memory_model_mem_w_ratio():
    t = simulate(one_rank("0F0 0F1 0B0 0B1 0W0 0W1"), Costs(mem_w_ratio=0.25))
    assert trace_values(t) == approx([0, 1, 2, 1.25, 0.5, 0.25, 0])


def test_per_stage_mem_w_ratio():
    schedule = Schedule.from_text("0: 0F0 0B0 0W0\n1: 1F0 1B0 1W0\n")
    t = simulate(schedule, Costs(mem_w_ratio=(1.0, 0.5)))
    assert [v for _, v in t.memory[1]] == [0, 1, 0.5, 0]  # the last stage frees half at B
    assert [v for _, v in t.memory[0]] == [0, 1, 0]
    with pytest.raises(ScheduleError, match="mem_w_ratio must be in"):
        Costs(mem_w_ratio=(1.0, 1.5))


def test_fused_backward_frees_and_takes_b_plus_w():
    t = simulate(one_rank("0F0 0BW0"), Costs(t_f=1, t_b=2, t_w=3))
    assert [(e.start, e.end) for e in t.events[0]] == [(0, 1), (1, 6)]
    assert trace_values(t) == [0, 1, 0]


def test_chunk_costs_scale_with_stage_fraction():
    t = simulate(schedules.get("interleaved-1f1b")(p=2, m=2, v=2), Costs(t_f=2, t_b=2, t_w=2, mem_b=3))
    durations = {e.end - e.start for evs in t.events for e in evs}
    assert durations == {1.0, 2.0}  # F = 2/2, BW = (2+2)/2
    assert t.peak_activation[0] == approx(4 * 1.5)  # all 4 chunk passes in flight, 3/2 each


def test_bubble_ratio_definition():
    t = simulate(schedules.get("1f1b")(p=4, m=8))
    span = t.makespan
    assert t.bubble_ratio == approx((span - max(t.busy(r) for r in range(4))) / span)
    assert t.summary()["peak_activation"] == [4, 3, 2, 1]


def test_span_bubble_leaves_out_the_fill():
    # GPipe p=2 m=1: rank 0 spans 0..6 (F, wait, BW), rank 1 spans 1..4
    t = simulate(schedules.get("gpipe")(p=2, m=1))
    assert [t.span(r) for r in range(2)] == [6, 3]
    assert t.bubble_ratio == approx(3 / 6) and t.bubble_ratio_span == approx(3 / 6)
    # a parallelogram: both ranks busy over their whole spans, shifted by one forward
    t = simulate(Schedule.from_text("0: 0F0 0F1 0B0 0W0 0B1 0W1\n1: 1F0 1B0 1F1 1B1 1W0 1W1\n"))
    assert t.busy(0) == t.busy(1) == 6
    assert t.bubble_ratio_span <= t.bubble_ratio


@pytest.mark.parametrize("bad", ["1,2", "a,b,c", "1,2,3,4,5", "1,-2,3"])
def test_bad_costs(bad):
    with pytest.raises(ScheduleError, match="--costs"):
        parse_costs(bad)


def test_negative_cost_values_rejected():
    with pytest.raises(ScheduleError, match="must be >= 0"):
        Costs(t_f=-1)
    with pytest.raises(ScheduleError, match="one value per stage"):
        simulate(schedules.get("1f1b")(p=2, m=2), Costs(t_f=(1.0, 1.0, 1.0)))


def test_analytic_formulas():
    cfg = TransformerConfig(layers=4, hidden=64, heads=4, seq=32, vocab=100, microbatch_size=2, dtype="bf16")
    hw = HARDWARE["a100"]
    costs = transformer_costs(cfg, hw, num_stages=4)
    s, b, h, a, V = 32, 2, 64, 4, 100
    rate = hw.flops * hw.efficiency
    # one layer per stage; stage 1 splits its backward as the Zero Bubble paper counts it
    assert costs.t_f[1] == approx(s * b * h * (24 * h + 4 * s) / rate)
    assert costs.t_b[1] == approx(s * b * h * (24 * h + 8 * s) / rate)
    assert costs.t_w[1] == approx(24 * s * b * h * h / rate)
    assert costs.t_b[1] + costs.t_w[1] == approx(2 * costs.t_f[1])
    # stage 0's input (token ids) needs no gradient: its B does nothing, W the whole backward
    assert costs.t_f[0] == approx(costs.t_f[1])
    assert costs.t_b[0] == 0.0 and costs.t_w[0] == approx(costs.t_b[1] + costs.t_w[1])
    split = transformer_costs(cfg, hw, num_stages=4, stage0_input_grad=True)  # sequence chunks: K/V gradients in B
    assert split.t_b[0] == approx(costs.t_b[1]) and split.t_w[0] == approx(costs.t_w[1])
    # Megatron's 34h + 5as per token (dropout, 16-bit), the LayerNorms' fp32 statistics (16
    # bytes per token), and the embedding's int64 ids and dropout mask on the first stage
    layer = s * b * (34 * h + 5 * a * s + 16)
    assert costs.mem_b[0] == approx(layer + 8 * s * b + 8 * s + s * b * h)
    assert costs.mem_b[1] == approx(layer)
    assert costs.mem_w_ratio == approx(32 * s * b * h / layer)
    # the last stage: the final LayerNorm (input, output, statistics) and the loss's fp32
    # log-probabilities, int64 targets and one scalar
    assert costs.mem_b[3] == approx(layer + s * b * (2 * 2 * h + 8) + s * b * (4 * V + 8) + 2)
    # the last stage also runs the LM head: 2*s*b*h*V FLOPs more in each of F, B and W, and in F its softmax
    # cross entropy reads the bf16 logits twice and writes fp32 log-probabilities at the memory's bandwidth
    assert costs.t_f[3] == approx((s * b * h * (24 * h + 4 * s) + 2 * s * b * h * V) / rate
                                  + s * b * V * (2 * 2 + 4) / hw.memory_bandwidth)
    assert costs.t_w[3] == approx((24 * s * b * h * h + 2 * s * b * h * V) / rate)
    assert costs.t_comm == approx(hw.latency + s * b * h * 2 / hw.bandwidth)


def test_layer_split_is_the_model_splitters_rule():
    from pipeblocks.core.cost.split import layer_counts

    assert layer_split(8, 4) == (2, 2, 2, 2)
    assert layer_split(10, 4) == (2, 3, 3, 2)  # the ends carry the embedding and the head
    for layers, stages in ((22, 8), (30, 8), (9, 4), (7, 4), (5, 2)):
        assert layer_split(layers, stages) == layer_counts(layers, stages)
        assert sum(layer_split(layers, stages)) == layers
    with pytest.raises(ValueError, match="3 transformer layers but the pipeline has 4 stages"):
        layer_split(3, 4)


def test_parse_model():
    assert parse_model("1.5b") is MODELS["1.5b"]
    assert parse_model("4,64,4,32").layers == 4
    with pytest.raises(ScheduleError, match="give a preset"):
        parse_model("big")
    with pytest.raises(ScheduleError, match="divisible by heads"):
        parse_model("4,65,4,32")


def test_analytic_costs_simulate_in_bytes():
    schedule = schedules.get("1f1b")(p=8, m=24)
    costs = transformer_costs(MODELS["1.5b"], HARDWARE["a100"], num_stages=8)
    t = simulate(schedule, costs)
    # rank 0 holds p microbatches of its layers
    assert t.peak_activation[0] == approx(8 * costs.mem_b[0])
    assert 0 < t.bubble_ratio < 0.5


def test_text_timeline_shows_every_pass():
    t = simulate(schedules.get("1f1b")(p=2, m=3))
    text = render_text_timeline(t)
    rows = [line for line in text.splitlines() if line.startswith("rank")]
    # rank 0 waits two slots for rank 1's BW0 (F0 at 1, BW0 over 2..4)
    assert rows[0].split()[2:] == ["F0", "F1", ".", ".", "BW0", "---", "F2", "BW1", "---", ".", "BW2", "---"]
    assert rows[1].split()[2:] == [".", "F0", "BW0", "---", "F1", "BW1", "---", "F2", "BW2", "---", ".", "."]


def test_plots_write_png_and_svg(tmp_path):
    t = simulate(schedules.get("interleaved-1f1b")(p=3, m=6))
    png = plot_timeline(t, tmp_path / "t.png")
    svg = plot_timeline(t, tmp_path / "t.svg", compare=t)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in svg.read_bytes()[:500]
    pareto = plot_pareto([ParetoPoint("1f1b", 3, 0.2), ParetoPoint("a", 2, 0.3, "curve"), ParetoPoint("b", 3, 0.1, "curve")],
                         tmp_path / "p.png")
    assert pareto.stat().st_size > 1000
    with pytest.raises(ScheduleError, match="suffix"):
        plot_timeline(t, tmp_path / "t.bmp")
