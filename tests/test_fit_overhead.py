"""The fit's fixed time per pass (`sim.hardware_profile`): time = FLOPs / (peak * f(I)) + t0,
chosen only when it fits clearly better; the end parts' own fixed times; the profile field,
old profiles without it, bad values; and the analytic model pricing it."""
from __future__ import annotations

import json

import pytest
from pytest import approx

from pipeblocks.cli.main import main
from pipeblocks.sim.analytic import TransformerConfig, layer_flops, layer_intensity, transformer_costs
from pipeblocks.sim.hardware_profile import (
    OVERHEAD_FORM, build_profile, fit_fraction, fit_part_overhead, link_fields, load_profile,
)

PEAK = 100e9
# per pass kind: ceiling, ridge, seconds of fixed time per pass of a block
TRUE = {"F": (0.8, 12.0, 150e-6), "B": (0.7, 20.0, 300e-6), "W": (0.9, 8.0, 0.0)}
SHAPES = ((10.0, 1e7), (15.0, 3e6), (20.0, 4e7), (40.0, 2e8), (80.0, 1e9))  # intensity, FLOPs


def _seconds(flops: float, intensity: float, ceiling: float, ridge: float, t0: float) -> float:
    return flops / (PEAK * ceiling / (1 + ridge / intensity)) + t0


def _fit_points(ceiling: float, ridge: float, t0: float) -> list[tuple[float, float, float]]:
    rows = []
    for intensity, flops in SHAPES:
        t = _seconds(flops, intensity, ceiling, ridge, t0)
        rows.append((intensity, flops / (t * PEAK), t))
    return rows


def test_the_fit_recovers_a_known_ceiling_ridge_and_overhead():
    fit = fit_fraction(_fit_points(0.8, 12.0, 150e-6))
    assert fit.chosen == OVERHEAD_FORM and fit.best is fit.overhead
    assert fit.overhead.ceiling == approx(0.8, rel=1e-6) and fit.overhead.ridge == approx(12.0, rel=1e-6)
    assert fit.overhead.overhead_s == approx(150e-6, rel=1e-6) and fit.overhead.rms_residual < 1e-9
    # the forms without it cannot follow the small shapes
    assert fit.roofline.rms_residual > 0.1 and fit.roofline.overhead_s == 0.0
    # a constant fraction plus overhead (R = 0) is found too
    flat = fit_fraction(_fit_points(0.6, 0.0, 80e-6))
    assert flat.chosen == OVERHEAD_FORM and flat.overhead.ridge < 1e-6 * 80
    assert flat.overhead.ceiling == approx(0.6, rel=1e-6) and flat.overhead.overhead_s == approx(80e-6, rel=1e-6)


def test_the_overhead_is_chosen_only_when_it_fits_clearly_better():
    # an exact roofline: the overhead's fit is as good (t0 = 0), not better: the roofline stays
    exact = fit_fraction(_fit_points(0.8, 12.0, 0.0))
    assert exact.chosen == "roofline" and exact.overhead.overhead_s == approx(0.0, abs=1e-12)
    # a roofline with +-5% noise and no fixed time: the overhead fits some of the noise, not clearly better
    noisy = []
    for k, (intensity, fraction, t) in enumerate(_fit_points(0.8, 12.0, 0.0)):
        slower = 1.05 if k % 2 else 0.95
        noisy.append((intensity, fraction / slower, t * slower))
    fit = fit_fraction(noisy)
    assert fit.overhead.rms_residual <= fit.roofline.rms_residual  # it has one parameter more ...
    assert fit.chosen == "roofline"  # ... but not 10% better per parameter
    # three points: a third parameter always fits them; never chosen
    few = fit_fraction(_fit_points(0.8, 12.0, 150e-6)[:3])
    assert few.overhead.rms_residual < 1e-6 and few.chosen != OVERHEAD_FORM
    # flat fractions: the constant, neither richer form
    assert fit_fraction([(10, 0.5, 1e-3), (20, 0.52, 2e-3), (40, 0.49, 4e-3), (80, 0.5, 8e-3)]).chosen == "constant"
    # without seconds there is no overhead form, as before
    untimed = fit_fraction([(i, f) for i, f, _ in _fit_points(0.8, 12.0, 150e-6)])
    assert untimed.overhead is None and untimed.chosen in ("constant", "roofline")
    with pytest.raises(ValueError, match="seconds"):
        fit_fraction([(10.0, 0.5, -1.0)])


def test_an_end_part_fixed_time_is_the_least_squares_t0():
    # flops_time + t0 = t exactly: t0 recovered; none without points; never below 0
    assert fit_part_overhead([(a, a + 2e-4) for a in (0.0, 1e-4, 5e-4, 2e-3)]) == approx(2e-4, rel=1e-9)
    assert fit_part_overhead([]) == 0.0
    assert fit_part_overhead([(2e-3, 1e-3), (4e-3, 2e-3)]) == 0.0


def _points() -> list[dict]:
    """Block points with TRUE's fixed times, an embedding (no FLOPs) and a head with their own."""
    rows = []
    for hidden, (intensity, flops) in zip((64, 96, 128, 256, 512), SHAPES):
        for kind, (ceiling, ridge, t0) in TRUE.items():
            common = {"pass": kind, "hidden": hidden, "seq": 64, "microbatch": 2, "heads": 4}
            rows.append({"part": "block", **common, "flops": flops, "intensity": intensity,
                         "seconds": _seconds(flops, intensity, ceiling, ridge, t0)})
            rows.append({"part": "embedding", **common, "flops": 0.0, "intensity": 0.0,
                         "seconds": 50e-6 if kind != "W" else 0.0})  # W timed as 0: stage 0's whole backward
            rows.append({"part": "head", **common, "flops": flops / 8, "intensity": intensity,
                         "seconds": _seconds(flops / 8, intensity, ceiling, ridge, 70e-6)})
    return rows


@pytest.fixture
def profile_file(tmp_path):
    links = link_fields([(4, 50e-6), (1 << 20, 50e-6 + (1 << 20) / 2e9)],
                        [(4, 100e-6), (1 << 20, 100e-6 + (1 << 20) / 1e9)], ranks=2)
    data = build_profile(name="slowbox", peak_flops=PEAK, peak_how="synthetic", points=_points(), links=links,
                         memory_bandwidth=None, ranks_per_node=2, about={"threads": 1})
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(data))
    return path


def test_the_profile_records_the_overheads_and_the_analytic_model_prices_them(profile_file):
    data = json.loads(profile_file.read_text())
    fits = data["fits"]
    assert fits["F"]["chosen"] == fits["B"]["chosen"] == OVERHEAD_FORM and fits["W"]["chosen"] == "roofline"
    assert fits["F"]["overhead_s"] == approx(150e-6, rel=1e-6) and fits["W"]["overhead_s"] == 0.0
    assert fits["F"][OVERHEAD_FORM]["overhead_s"] == approx(150e-6, rel=1e-6)
    assert fits["F"]["embedding_overhead_s"] == approx(50e-6) and fits["B"]["head_overhead_s"] == approx(70e-6)
    assert "embedding_overhead_s" not in fits["W"]  # a part timed as 0 has no time of its own
    assert all(abs(p["residual"]) < 1e-6 for p in data["points"] if p["part"] != "embedding" or p["pass"] != "W")
    hw = load_profile(profile_file)
    assert [hw.overhead(k) for k in range(3)] == [approx(150e-6, rel=1e-6), approx(300e-6, rel=1e-6), 0.0]
    config = TransformerConfig(layers=4, hidden=256, heads=4, seq=64, vocab=256, microbatch_size=2, dtype="fp32")
    costs = transformer_costs(config, hw, num_stages=2, stage0_input_grad=True)
    flops_f = layer_flops(config)[0] / (PEAK * hw.fraction(0, layer_intensity(config)))
    # stage 0: two blocks' F, each with its fixed time, and the embedding's
    assert costs.t_f[0] == approx(2 * (flops_f + 150e-6) + 50e-6)
    # stage 1's B: the head's fixed time beside the blocks'
    without_head = transformer_costs(config, _no_end_parts(hw), num_stages=2, stage0_input_grad=True)
    assert costs.t_b[1] - without_head.t_b[1] == approx(70e-6)


def _no_end_parts(hw):
    import dataclasses

    return dataclasses.replace(hw, passes=tuple(dataclasses.replace(p, embedding_overhead=0.0, head_overhead=0.0)
                                                for p in hw.passes))


def test_an_old_profile_without_the_fields_loads_with_no_overhead(profile_file):
    data = json.loads(profile_file.read_text())
    for fit in data["fits"].values():
        for name in ("overhead_s", "embedding_overhead_s", "head_overhead_s"):
            fit.pop(name, None)
    profile_file.write_text(json.dumps(data))
    hw = load_profile(profile_file)
    assert all(hw.overhead(k, part) == 0.0 for k in range(3) for part in ("block", "embedding", "head"))


@pytest.mark.parametrize("kind, name, value", [
    ("F", "overhead_s", "150us"), ("B", "overhead_s", -1e-6), ("W", "overhead_s", float("nan")),
    ("F", "embedding_overhead_s", True), ("B", "head_overhead_s", float("inf")),
])
def test_a_bad_overhead_is_refused_in_one_line_naming_the_file_and_the_field(profile_file, capsys, kind, name, value):
    data = json.loads(profile_file.read_text())
    data["fits"][kind][name] = value
    profile_file.write_text(json.dumps(data))
    code = main(["simulate", "1f1b", "-p", "2", "-m", "4", "--model", "4,256,4,64", "--hardware", str(profile_file)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert str(profile_file) in err and f"fits.{kind}.{name}" in err
