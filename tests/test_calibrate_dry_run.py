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
    from pipeblocks.core.costs import Costs
    from pipeblocks.core.simulate import simulate
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
    f, b, w, t_comm = predicted_times(split_stages(spec, model, 2), tokens[:, :-1], spec.loss, tokens[:, 1:],
                                      load_profile(profile))
    assert b[0] == 0.0 and w[0] > 0 and b[1] > 0 and t_comm > 0
    want = simulate(schedules.get("zb-h1")(p=2, m=2), Costs(t_f=f, t_b=b, t_w=w, t_comm=t_comm)).makespan
    assert shown == pytest.approx(want * 1e3, abs=0.051)
