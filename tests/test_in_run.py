"""Passes inside a run: `calibrate` measures how much longer a rank of a 1F1B and of a v-half
run takes its passes than the profile predicts (`runtime.in_run`, `predict.in_run_factors`),
and `train --dry-run --hardware` multiplies its predicted passes by the factor of the run's
chunks per rank."""
from __future__ import annotations

import json

import pytest

from pipeblocks.train.predict import profile_in_run_factor


def _profile(tmp_path, factors) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"in_run": {"factors": factors}}))
    return str(path)


def test_the_factor_of_the_runs_chunks_per_rank_or_the_largest_measured_below(tmp_path):
    profile = _profile(tmp_path, {"1": 0.97, "2": 1.2})
    assert profile_in_run_factor(profile, 1) == 0.97
    assert profile_in_run_factor(profile, 2) == 1.2
    assert profile_in_run_factor(profile, 4) == 1.2  # more chunks alternate as two do: the 2-chunk factor
    assert profile_in_run_factor(_profile(tmp_path, {"2": 1.2}), 1) is None
    assert profile_in_run_factor(_profile(tmp_path, {"2": -1, "x": 3}), 2) is None  # nonsense is not used
    assert profile_in_run_factor("a100", 2) is None  # a preset measured nothing


@pytest.mark.torch
def test_in_run_factors_compare_the_runs_passes_with_the_profiles_prediction():
    from pipeblocks import schedules
    from pipeblocks.runtime.calibrate import Shape
    from pipeblocks.runtime.in_run import in_run_model
    from pipeblocks.sim.hardware_profile import resolve_hardware
    from pipeblocks.train.predict import _tokens, in_run_factors, predicted_times

    shape, hardware = Shape(32, 16, 2, 2), resolve_hardware("a100")
    measured = {}
    for name, slower in (("1f1b", 1.25), ("v-half", 1.5)):
        schedule = schedules.get(name)(p=2, m=2)
        spec, stages = in_run_model("gpt", shape, "fp32", schedule.num_stages)
        tokens = _tokens(shape)
        f, b, w, _ = predicted_times(stages, tokens[:, :-1], spec.loss, tokens[:, 1:], hardware,
                                     split=schedule.has_split_backward)
        passes = {f"{s}F": f[s] * slower for s in range(schedule.num_stages)}
        for s in range(schedule.num_stages):
            passes.update({f"{s}B": b[s] * slower, f"{s}W": w[s] * slower} if schedule.has_split_backward
                          else {f"{s}BW": (b[s] + w[s]) * slower})
        measured[name] = {"chunks": schedule.num_stages // 2, "passes": passes}
    factors = in_run_factors(hardware, "gpt", shape, "fp32", measured)
    assert factors == pytest.approx({"1": 1.25, "2": 1.5})


@pytest.mark.torch
def test_the_dry_run_multiplies_the_predicted_passes_by_the_factor(tmp_path, capsys):
    import torch

    from pipeblocks import schedules
    from pipeblocks.cli.main import main
    from pipeblocks.core.cost.costs import Costs
    from pipeblocks.core.simulator.simulate import simulate
    from pipeblocks.models import build_model, split_stages
    from pipeblocks.models.family import get_family
    from pipeblocks.sim.hardware_profile import load_profile
    from pipeblocks.train.predict import predicted_times

    profile = tmp_path / "p.json"
    assert main(["calibrate", "--shapes", "32x16x2x2,64x16x2x2", "--no-links", "--repeats", "1", "--threads", "1",
                 "-o", str(profile)]) == 0
    data = json.loads(profile.read_text())
    assert "in_run" not in data  # --no-links: no processes started, nothing measured inside a run
    data["in_run"] = {"factors": {"1": 1.5, "2": 3.0}}
    profile.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["train", "--dry-run", "--schedule", "zb-h1", "-p", "2", "-m", "2", "--layers", "2", "--hidden", "32",
                 "--heads", "2", "--seq", "16", "--microbatch-size", "2", "--hardware", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "x 1.50 as inside a run of 1 chunk(s) per rank" in out
    shown = float(out.split("predicted iteration time ")[1].split(" ms")[0])
    fam = get_family("gpt")
    spec = fam.spec(fam.config(layers=2, hidden=32, heads=2, seq=16, vocab=256))
    tokens = torch.randint(0, 256, (2, 17))
    f, b, w, t_comm = predicted_times(split_stages(spec, build_model(spec, seed=0), 2), tokens[:, :-1], spec.loss,
                                      tokens[:, 1:], load_profile(profile))
    scaled = [tuple(t * 1.5 for t in times) for times in (f, b, w)]
    want = simulate(schedules.get("zb-h1")(p=2, m=2), Costs(*scaled, t_comm=t_comm)).makespan
    assert shown == pytest.approx(want * 1e3, abs=0.051)


@pytest.mark.spawn
def test_calibrate_measures_every_pass_of_both_runs_on_two_processes():
    from pipeblocks.runtime.calibrate import Shape
    from pipeblocks.runtime.in_run import measure_in_run

    measured = measure_in_run("gpt", Shape(16, 16, 1, 2), precision="fp32", threads=1, m=4, steps=2, warmup=1)
    assert measured["1f1b"]["chunks"] == 1 and measured["v-half"]["chunks"] == 2
    assert set(measured["1f1b"]["passes"]) == {"0F", "0BW", "1F", "1BW"}
    assert set(measured["v-half"]["passes"]) == {f"{s}{k}" for s in range(4) for k in "FBW"}
    assert all(t > 0 for run in measured.values() for t in run["passes"].values())
