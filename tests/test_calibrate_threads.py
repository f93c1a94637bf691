"""`calibrate` times with a rank's torch threads: `--ranks` and `--threads` resolved to the
threads `pipeblocks train` gives a rank, and the dry run's warning when a profile's threads
are not a rank's (pure Python; the runs are in test_calibrate_dry_run.py)."""
from __future__ import annotations

import json

import pytest

from pipeblocks.cli.calibrate import calibration_threads
from pipeblocks.train.config import threads_per_rank
from pipeblocks.train.predict import threads_mismatch
from pipeblocks.train.run import DEFAULT_P


@pytest.mark.parametrize("ranks, cores, threads", [(2, 2, 1), (4, 2, 1), (1, 2, 2), (2, 16, 8), (3, 16, 5)])
def test_a_rank_has_the_cores_divided_among_the_local_ranks(ranks, cores, threads):
    assert threads_per_rank(ranks, cores) == threads


@pytest.mark.parametrize("ranks", [0, -1, True, 1.5])
def test_local_ranks_must_be_a_positive_integer(ranks):
    with pytest.raises(ValueError, match="local ranks must be an integer >= 1"):
        threads_per_rank(ranks, 4)


def test_the_default_times_as_a_rank_of_train_s_default_run():
    # train's default -p, so that `calibrate` then `train --dry-run --hardware` agree as they stand
    assert DEFAULT_P == 2
    assert calibration_threads(ranks=None, threads=None, cores=2) == (1, 2)
    assert calibration_threads(ranks=None, threads=None, cores=16) == (8, 2)


def test_ranks_and_threads_resolve_and_a_contradiction_is_an_error():
    assert calibration_threads(ranks=4, threads=None, cores=16) == (4, 4)
    assert calibration_threads(ranks=None, threads=3, cores=16) == (3, None)  # --threads alone: as given
    assert calibration_threads(ranks=4, threads=4, cores=16) == (4, 4)  # both, agreeing
    with pytest.raises(ValueError) as err:
        calibration_threads(ranks=2, threads=2, cores=2)
    assert str(err.value) == ("--threads 2 and --ranks 2 disagree: one of 2 local ranks on 2 cores has 1 torch "
                              "thread(s); give one of the two")


def _profile(tmp_path, threads):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"format": "pipeblocks-hardware-profile/1", "threads": threads}))
    return str(path)


def test_a_profile_measured_with_other_threads_is_one_warning_naming_both_and_the_fix(tmp_path):
    path = _profile(tmp_path, 2)
    warning = threads_mismatch(path, threads=1, local_ranks=2, cores=2)
    assert warning == (f"warning: hardware profile {path} was measured with 2 torch thread(s), a rank of this run has "
                       "1 (2 cores // 2 local ranks): its pass times are predicted for 2; recalibrate with "
                       "`pipeblocks calibrate --ranks 2` (or `--threads 1`)")
    # threads the run sets itself (not the cores' share): only --threads fixes it
    assert threads_mismatch(path, threads=3, local_ranks=2, cores=2).endswith("`pipeblocks calibrate --threads 3`")


def test_no_warning_when_the_threads_agree_or_the_profile_does_not_say(tmp_path):
    assert threads_mismatch(_profile(tmp_path, 1), threads=1, local_ranks=2, cores=2) is None
    assert threads_mismatch(_profile(tmp_path, None), threads=1, local_ranks=2, cores=2) is None
    assert threads_mismatch("a100", threads=1, local_ranks=2, cores=2) is None  # a preset


def test_the_runtimes_time_between_passes_is_added_to_every_pass_a_rank_runs(tmp_path):
    """A profile's `links.between_passes_s` (what `calibrate` measures on its two link
    processes) goes onto F, B and W under a split backward (a stage without B keeps 0), and
    once onto the fused backward otherwise."""
    import json

    from pipeblocks.train.predict import profile_between_passes, with_runtime_time

    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"links": {"between_passes_s": 0.002}}))
    assert profile_between_passes(str(profile)) == 0.002
    assert profile_between_passes("a100") is None
    f, b, w = (1.0, 1.0), (0.0, 2.0), (3.0, 1.0)
    assert with_runtime_time(f, b, w, 0.002, split=True) == ((1.002, 1.002), (0.0, 2.002), (3.002, 1.002))
    assert with_runtime_time(f, b, w, 0.002, split=False) == ((1.002, 1.002), (0.002, 2.002), (3.0, 1.0))
    assert with_runtime_time(f, b, w, None, split=True) == (f, b, w)
