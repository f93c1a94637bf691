"""Hardware profiles (`pipeblocks calibrate`'s files): the fit, the file's checks, and
`--hardware PROFILE.json` in every command that takes --hardware."""
from __future__ import annotations

import json
import math

import pytest
from pytest import approx

from pipeblocks.cli.main import main
from pipeblocks.sim.analytic import HARDWARE, TransformerConfig, layer_intensity, transformer_costs
from pipeblocks.sim.hardware_profile import (
    FORMAT, build_profile, fit_fraction, link_fields, load_profile, resolve_hardware,
)

PEAK = 100e9
CEILING, RIDGE = {"F": (0.8, 12.0), "B": (0.7, 20.0), "W": (0.75, 15.0)}, None


def _points() -> list[dict]:
    """Block points that follow the roofline exactly, and a head point off it."""
    rows = []
    for hidden, intensity in ((64, 10.0), (128, 20.0), (256, 40.0), (512, 80.0)):
        for kind, (ceiling, ridge) in CEILING.items():
            flops = 1e8 * hidden / 64
            fraction = ceiling / (1 + ridge / intensity)
            rows.append({"part": "block", "pass": kind, "hidden": hidden, "seq": 64, "microbatch": 2, "heads": 4,
                         "seconds": flops / (PEAK * fraction), "flops": flops, "intensity": intensity})
    rows.append({"part": "embedding", "pass": "F", "hidden": 64, "seq": 64, "microbatch": 2, "heads": 4,
                 "seconds": 1e-4, "flops": 0.0, "intensity": 0.0})
    return rows


@pytest.fixture
def profile_file(tmp_path):
    links = link_fields([(4, 50e-6), (1 << 20, 50e-6 + (1 << 20) / 2e9)],
                        [(4, 100e-6), (1 << 20, 100e-6 + (1 << 20) / 1e9)], ranks=2)
    data = build_profile(name="testbox", peak_flops=PEAK, peak_how="synthetic", points=_points(), links=links,
                         memory_bandwidth=20e9, ranks_per_node=2, about={"threads": 1})
    path = tmp_path / "box.json"
    path.write_text(json.dumps(data))
    return path


def test_the_fit_recovers_a_roofline_and_prefers_a_constant_for_flat_points():
    fit = fit_fraction([(i, 0.8 / (1 + 12 / i)) for i in (10, 20, 40, 80)])
    assert fit.chosen == "roofline"
    assert fit.roofline.ceiling == approx(0.8, rel=1e-3) and fit.roofline.ridge == approx(12, rel=1e-3)
    assert fit.roofline.rms_residual < 1e-3 < fit.constant.rms_residual
    flat = fit_fraction([(10, 0.5), (20, 0.52), (40, 0.49), (80, 0.5)])
    assert flat.chosen == "constant" and flat.best.ceiling == approx(0.5, rel=0.03)
    # a fraction rising faster than any roofline allows: the ceiling stays at most the peak
    assert fit_fraction([(9.6, 0.118), (27.4, 0.562)]).roofline.ceiling <= 1.0
    with pytest.raises(ValueError, match="no points"):
        fit_fraction([])


def test_a_profile_loads_into_the_hardware_the_analytic_model_prices_with(profile_file):
    hw = resolve_hardware(str(profile_file))
    assert hw.name == "testbox" and hw.flops == PEAK and hw.gpus_per_node == 2
    assert hw.latency == approx(50e-6, rel=1e-3) and hw.bandwidth == approx(2e9, rel=1e-3)
    # a 2-rank ring: 2(d-1) = 2 steps of latency, 2(d-1)/d = 1 x the message over the bandwidth
    assert hw.intra_latency == approx(50e-6, rel=1e-3) and hw.intra_bandwidth == approx(1e9, rel=1e-3)
    for kind, (ceiling, ridge) in zip(range(3), CEILING.values()):
        assert hw.passes[kind].ceiling == approx(ceiling, rel=1e-3) and hw.passes[kind].ridge == approx(ridge, rel=1e-3)
    config = TransformerConfig(layers=4, hidden=256, heads=4, seq=64, vocab=256, microbatch_size=2, dtype="fp32")
    costs = transformer_costs(config, hw, num_stages=2)
    s, b, h = 64, 2, 256
    fraction_f = hw.passes[0].at(layer_intensity(config))
    # the blocks follow the roofline exactly (no overhead); the embedding's F, 1e-4 s without FLOPs, is its own
    assert hw.overhead(0) == 0.0 and hw.overhead(0, "embedding") == approx(1e-4)
    assert costs.t_f[0] == approx(2 * s * b * h * (24 * h + 4 * s) / (PEAK * fraction_f) + 1e-4)
    assert costs.t_b[0] == 0.0  # stage 0: the whole backward in W
    assert resolve_hardware("a100") is HARDWARE["a100"]


def _profile_round_trip(args: list[str], capsys) -> str:
    assert main(args) == 0
    return capsys.readouterr().out


def test_simulate_compare_plot_and_plan_take_a_profile(profile_file, capsys, tmp_path):
    model = ["--model", "4,256,4,64,256,2"]
    hw = ["--hardware", str(profile_file)]
    ours = json.loads(_profile_round_trip(["simulate", "1f1b", "-p", "2", "-m", "4", *model, *hw, "--json"], capsys))
    a100 = json.loads(_profile_round_trip(["simulate", "1f1b", "-p", "2", "-m", "4", *model, "--json"], capsys))
    hardware = load_profile(profile_file)
    config = TransformerConfig(layers=4, hidden=256, heads=4, seq=64, vocab=256, microbatch_size=2)
    want = transformer_costs(config, hardware, num_stages=2)
    assert ours["makespan"] > 10 * a100["makespan"]  # a 100 GFLOP/s box, not an A100
    assert ours["makespan"] >= 4 * (want.t_f[0] + want.t_f[1])
    table = _profile_round_trip(["compare", "--schedules", "1f1b,zb-h1", "-p", "2", "-m", "4", *model, *hw], capsys)
    assert str(profile_file) in table
    plot = tmp_path / "t.png"
    _profile_round_trip(["plot", "zb-h1", "-p", "2", "-m", "4", *model, *hw, "-o", str(plot)], capsys)
    assert plot.stat().st_size > 0
    plan = json.loads(_profile_round_trip(
        ["plan", "--model", "4,256,4,64", "--gpus", "2", "--gpu-memory", "80", "--global-batch", "8",
         "--schedules", "1f1b", "--microbatch-sizes", "1", "--jobs", "1", *hw, "--json"], capsys))
    assert "testbox" in json.dumps(plan)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["peak"].update(flops=float("nan")), "peak.flops"),
    (lambda d: d["fits"]["B"].update(ceiling=-1), "fits.B.ceiling"),
    (lambda d: d["links"]["p2p"].pop("latency_s"), "links.p2p.latency_s"),
    (lambda d: d.update(format="something else"), "format"),
    (lambda d: d["fits"].pop("W"), "fits.W"),
])
def test_a_bad_profile_is_refused_in_one_line_naming_the_file_and_the_field(profile_file, capsys, edit, field):
    data = json.loads(profile_file.read_text())
    edit(data)
    profile_file.write_text(json.dumps(data))  # NaN is written as NaN, as a careless tool would
    code = main(["simulate", "1f1b", "-p", "2", "-m", "4", "--model", "4,256,4,64", "--hardware", str(profile_file)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert str(profile_file) in err and field in err


def test_a_missing_or_unreadable_profile_and_an_unknown_name_are_one_line(tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for text, words in ((str(tmp_path / "none.json"), "does not exist"), (str(broken), "is not JSON"),
                        ("h200", "not a preset")):
        code = main(["simulate", "1f1b", "--model", "4,256,4,64", "--hardware", text])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1


def test_profile_document_fields_are_finite_and_say_how_peak_was_had(profile_file):
    data = json.loads(profile_file.read_text())
    assert data["format"] == FORMAT and data["peak"]["how"] == "synthetic"
    assert set(data["fits"]) == {"F", "B", "W"} and all(data["fits"][k]["chosen"] == "roofline" for k in "FBW")
    blocks = [p for p in data["points"] if p["part"] == "block"]
    assert all(abs(p["residual"]) < 1e-3 and math.isfinite(p["fraction"]) for p in blocks)
    assert 0 < data["efficiency"] <= 1


def test_stage0_runs_its_whole_backward_in_w_with_tensor_parallelism_too(capsys):
    """Stage 0's input needs no gradient: B is 0 and W holds its compute and its TP collectives."""
    from pipeblocks.plan.costs import replica_costs

    config = TransformerConfig(layers=8, hidden=1024, heads=16, seq=512, vocab=1024)
    costs = replica_costs(config, HARDWARE["a100-80g"], num_stages=4, dp=1, tp=2)
    whole = replica_costs(config, HARDWARE["a100-80g"], num_stages=4, dp=1, tp=1)
    assert costs.t_b[0] == 0.0 and costs.t_b[1] > 0
    # stages 0 and 1 hold two layers each: stage 0's W is stage 1's B + W, collectives included
    assert costs.t_w[0] == approx(costs.t_b[1] + costs.t_w[1]) and costs.t_w[0] > whole.t_w[0] / 2
    out = json.loads(_profile_round_trip(["simulate", "zb-h1", "-p", "2", "-m", "4", "--tp", "2", "--model",
                                          "4,1024,16,512,1024", "--json"], capsys))
    assert out["makespan"] > 0

