"""`train --dry-run --hardware PROFILE.json`: the dry run predicts from a calibrated profile."""
from __future__ import annotations

import pytest
import torch

from pipeblocks.cli.main import main
from pipeblocks.sim.hardware_profile import load_profile

pytestmark = pytest.mark.torch


def test_train_dry_run_predicts_from_a_profile(tmp_path, capsys):
    """`train --dry-run --hardware PROFILE.json`: pass times from the profile's fits and the
    FLOPs counted on the run's stages, not timed here; the hop from its link."""
    from pipeblocks.core.cost.costs import Costs
    from pipeblocks.core.simulator.simulate import simulate
    from pipeblocks import schedules
    from pipeblocks.models.family import get_family
    from pipeblocks.train.predict import predicted_times

    profile = tmp_path / "p.json"
    assert main(["calibrate", "--shapes", "32x16x2x2,64x16x2x2", "--no-links", "--repeats", "1", "--threads", "1",
                 "-o", str(profile)]) == 0
    capsys.readouterr()
    args = ["train", "--dry-run", "--schedule", "zb-h1", "-p", "2", "-m", "2", "--layers", "2", "--hidden", "32",
            "--heads", "2", "--seq", "16", "--microbatch-size", "2", "--hardware", str(profile)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"predicted from hardware {profile}" in out
    shown = float(out.split("predicted iteration time ")[1].split(" ms")[0])
    from pipeblocks.models import build_model, split_stages

    fam = get_family("gpt")
    spec = fam.spec(fam.config(layers=2, hidden=32, heads=2, seq=16, vocab=256))
    model = build_model(spec, seed=0)
    tokens = torch.randint(0, 256, (2, 17))
    hardware = load_profile(profile)
    f, b, w, t_comm = predicted_times(split_stages(spec, model, 2), tokens[:, :-1], spec.loss, tokens[:, 1:],
                                      hardware)
    # stage 0's B runs no FLOPs: only the embedding's fixed time
    assert b[0] == hardware.overhead(1, "embedding") and w[0] > 0 and b[1] > 0 and t_comm > 0
    want = simulate(schedules.get("zb-h1")(p=2, m=2), Costs(t_f=f, t_b=b, t_w=w, t_comm=t_comm)).makespan
    assert shown == pytest.approx(want * 1e3, abs=0.051)


def _grid(tmp_path, *args: str) -> dict:
    """calibrate at a two-shape grid with `args`; the profile written."""
    out = tmp_path / "grid.json"
    assert main(["calibrate", "--device", "cpu", "--shapes", "32x16x2x2,64x16x2x2", "--no-links", "--repeats", "1",
                 *args, "-o", str(out)]) == 0
    import json

    return json.loads(out.read_text())


def test_calibrate_times_as_one_of_the_local_ranks_and_records_it(tmp_path, capsys, monkeypatch):
    import os

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    default = _grid(tmp_path)  # train's default p = 2 ranks share 4 cores
    assert (default["threads"], default["ranks"]) == (2, 2)
    assert "2 thread(s)" in default["peak"]["how"]
    four = _grid(tmp_path, "--ranks", "4")
    assert (four["threads"], four["ranks"]) == (1, 4)
    given = _grid(tmp_path, "--threads", "3")
    assert (given["threads"], given["ranks"]) == (3, None)
    assert "calibrate: 3 torch thread(s) (--threads on 4 cores)" in capsys.readouterr().err
    assert torch.get_num_threads() == before  # the caller's threads are restored


def test_ranks_and_threads_that_disagree_are_one_line(tmp_path, capsys, monkeypatch):
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    code = main(["calibrate", "--device", "cpu", "--ranks", "2", "--threads", "2", "-o", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--threads 2 and --ranks 2 disagree: one of 2 local ranks on 2 cores has 1 torch thread(s)" in err
    assert not (tmp_path / "x.json").exists()


def _synthetic_profile(path, threads: int) -> str:
    """A profile file as calibrate writes it, from made-up points (nothing timed)."""
    import json

    from pipeblocks.sim.hardware_profile import build_profile

    points = [{"part": "block", "pass": kind, "seconds": seconds, "flops": 1e8, "intensity": intensity}
              for kind in ("F", "B", "W") for seconds, intensity in ((2e-3, 20.0), (1.5e-3, 60.0))]
    profile = build_profile(name="synthetic", peak_flops=1e11, peak_how="made up", points=points,
                            about={"threads": threads, "ranks": None})
    path.write_text(json.dumps(profile))
    return str(path)


def test_dry_run_warns_once_when_the_profile_has_other_threads_than_a_rank(tmp_path, capsys, monkeypatch):
    import io
    import os

    from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
    from pipeblocks.models.config import GPTConfig
    from pipeblocks.train.run import dry_run, prepare

    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # p = 2: one thread a rank
    args = ["train", "--dry-run", "--schedule", "1f1b", "-p", "2", "-m", "2", "--layers", "2", "--hidden", "32",
            "--heads", "2", "--seq", "16", "--microbatch-size", "2", "--device", "cpu"]
    two = _synthetic_profile(tmp_path / "two.json", threads=2)
    assert main([*args, "--hardware", two]) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        f"warning: hardware profile {two} was measured with 2 torch thread(s), a rank of this run has 1 (2 cores // 2 "
        "local ranks): its pass times are predicted for 2; recalibrate with `pipeblocks calibrate --ranks 2` (or "
        "`--threads 1`)"]
    assert f"predicted from hardware {two}; measured with 2 torch threads, a rank here has 1" in out
    one = _synthetic_profile(tmp_path / "one.json", threads=1)
    assert main([*args, "--hardware", one]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err and "measured with" not in out
    # the figures say both numbers
    request = ScheduleRequest(name="1f1b", m=2, mesh=Mesh(pp=2), costs=CostSpec(hardware=two))
    cfg, data = prepare(request, model=GPTConfig(layers=2, hidden=32, heads=2, seq=16), microbatch_size=2, steps=1,
                        device="cpu")
    figures = dry_run(cfg, data, out=io.StringIO(), hardware=two)
    assert (figures["threads_per_rank"], figures["profile_threads"]) == (1, 2)


def test_the_dry_run_adds_the_fixed_time_per_block_and_the_end_parts():
    """predicted_times: each stage's passes get the profile's fixed time per block, the first
    stage the embedding's, the last the head's; a backward run as one pass (stage 0's W, or
    B + W without a split backward) pays the mean of B's and W's once per block."""
    import dataclasses

    from pipeblocks.models import build_model, split_stages
    from pipeblocks.models.family import get_family
    from pipeblocks.sim.analytic import HARDWARE, PassEfficiency
    from pipeblocks.train.predict import predicted_times

    fam = get_family("gpt")
    spec = fam.spec(fam.config(layers=4, hidden=32, heads=2, seq=16, vocab=64))
    stages = split_stages(spec, build_model(spec, seed=0), 2)
    tokens = torch.randint(0, 64, (2, 17))
    plain = dataclasses.replace(HARDWARE["a100"], passes=(PassEfficiency(0.5),) * 3)
    fixed = dataclasses.replace(plain, passes=tuple(PassEfficiency(0.5, 0.0, t, 1e-5 * (k + 1), 2e-5 * (k + 1))
                                                    for k, t in enumerate((1e-4, 3e-4, 2e-4))))
    args = (stages, tokens[:, :-1], spec.loss, tokens[:, 1:])
    (f0, b0, w0, _), (f1, b1, w1, _) = predicted_times(*args, plain), predicted_times(*args, fixed)
    two = 2  # blocks per stage
    assert f1[0] - f0[0] == pytest.approx(two * 1e-4 + 1e-5) and f1[1] - f0[1] == pytest.approx(two * 1e-4 + 2e-5)
    assert b1[0] - b0[0] == pytest.approx(2e-5)  # stage 0's B: the embedding's alone
    assert w1[0] - w0[0] == pytest.approx(two * (3e-4 + 2e-4) / 2 + 3e-5)  # the whole backward, one pass
    assert b1[1] - b0[1] == pytest.approx(two * 3e-4 + 4e-5) and w1[1] - w0[1] == pytest.approx(two * 2e-4 + 6e-5)
    _, fb, fw, _ = predicted_times(*args, fixed, split=False)
    assert (fb[1] + fw[1]) - (b0[1] + w0[1]) == pytest.approx(two * (3e-4 + 2e-4) / 2 + 4e-5 + 6e-5)
