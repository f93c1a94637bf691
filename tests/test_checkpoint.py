"""Checkpoint verification: damaged files, the agreed resume step, a used directory, temporaries."""
from __future__ import annotations

import json
import re

import pytest
import torch

from pipeblocks.cli.main import main
from pipeblocks.models import GPTConfig, build_stages
from pipeblocks.train import checkpoint as ckpt
from test_train import SMALL, _train

pytestmark = pytest.mark.spawn

TINY = GPTConfig(layers=2, hidden=16, heads=2, seq=8, vocab=32, dtype="float64")


def _save(directory, rank: int, step: int) -> None:
    stages = {s.index: s for s in build_stages(TINY, seed=0, num_stages=2, stages=(0, 1))}
    opt = torch.optim.AdamW([p for s in stages.values() for p in s.parameters()])
    ckpt.save_rank(directory, rank=rank, step=step, stages=stages, optimizer=opt, meta={"run": "a"})


def _flip_byte(path, offset: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [
    (lambda d: _flip_byte(ckpt.checkpoint_path(d, 1, 2)), "sha256 differs"),
    (lambda d: ckpt.checkpoint_path(d, 1, 2).write_bytes(ckpt.checkpoint_path(d, 1, 2).read_bytes()[:-10]),
     "bytes, manifest says"),
    (lambda d: ckpt.manifest_path(d, 1, 2).unlink(), "no manifest"),
    (lambda d: ckpt.manifest_path(d, 1, 2).write_text("{"), "unreadable manifest"),
    (lambda d: ckpt.checkpoint_path(d, 1, 2).unlink(), "file missing"),
], ids=["flipped-byte", "truncated", "no-manifest", "bad-manifest", "no-file"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_on_every_rank(tmp_path, damage, reason):
    for rank in (0, 1):
        for step in (1, 2):
            _save(tmp_path, rank, step)
    assert ckpt.latest_step(tmp_path, world_size=2) == 2
    damage(tmp_path)
    checks = [ckpt.verify_rank(tmp_path, r) for r in (0, 1)]
    assert checks[0].intact == (1, 2) and checks[1].intact == (1,)
    (path, why), = checks[1].damaged
    assert path.endswith("rank1-step00000002.pt") and reason in why
    assert ckpt.agree_step(checks) == 1 == ckpt.latest_step(tmp_path, world_size=2)
    with pytest.raises(ValueError, match=r"rank1-step00000002\.pt.*cannot be used"):
        ckpt.load_rank(tmp_path, rank=1, step=2)
    assert ckpt.load_rank(tmp_path, rank=1, step=1)["step"] == 1


def test_no_intact_step_names_every_damaged_file(tmp_path):
    _save(tmp_path, 0, 1)
    _save(tmp_path, 1, 2)  # the ranks share no step
    _flip_byte(ckpt.checkpoint_path(tmp_path, 0, 1))
    checks = [ckpt.verify_rank(tmp_path, r) for r in (0, 1)]
    assert ckpt.agree_step(checks) is None
    message = ckpt.no_intact_message(tmp_path, checks)
    assert "no checkpoint" in message and "intact on all 2 ranks" in message
    assert "rank0-step00000001.pt (sha256 differs from the manifest)" in message
    assert "rank 1 intact steps [2]" in message and "drop --resume" in message


def test_a_used_directory_is_refused_or_overwritten_and_other_files_are_kept(tmp_path):
    assert ckpt.claim_directory(tmp_path / "new", overwrite=False) == []
    debris = tmp_path / ".rank0-step00000001.pt.u7w"  # an interrupted first save is no run to protect
    debris.write_bytes(b"partial")
    assert ckpt.claim_directory(tmp_path, overwrite=False, dry_run=True) == [] and debris.exists()
    assert ckpt.claim_directory(tmp_path, overwrite=False) == [] and not debris.exists()
    _save(tmp_path, 0, 3)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds 2 checkpoint file\(s\) of another run \(steps \[3\]\).*"
                                         r"--resume.*--overwrite"):
        ckpt.claim_directory(tmp_path, overwrite=False)
    assert ckpt.claim_directory(tmp_path, overwrite=True, dry_run=True)
    assert len(ckpt.existing_files(tmp_path)) == 2  # a dry run removes nothing
    removed = ckpt.claim_directory(tmp_path, overwrite=True)
    assert len(removed) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_temporaries_of_an_interrupted_save_are_removed_and_an_error_mid_save_leaves_none(tmp_path, monkeypatch):
    _save(tmp_path, 0, 1)
    left = [tmp_path / ".rank0-step00000002.pt.k3j9x", tmp_path / ".rank1-step00000002.manifest.json.a8",
            tmp_path / ".hidden-but-not-ours"]
    for f in left:
        f.write_bytes(b"partial")
    assert ckpt.remove_temporaries(tmp_path, ranks=[0]) == [left[0]]
    assert ckpt.remove_temporaries(tmp_path) == [left[1]]
    assert left[2].exists()

    def failing_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 0, 2)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("rank") or p.name.startswith(".rank")) \
        == ["rank0-step00000001.manifest.json", "rank0-step00000001.pt"]
    assert ckpt.latest_step(tmp_path, world_size=1) == 1


# ---- through `pipeblocks train` ---------------------------------------------------------


def test_resume_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path):
    run = ["--schedule", "1f1b", *SMALL, "--checkpoint", str(tmp_path / "ck"), "--quiet"]
    _save(tmp_path / "ck", 0, 7)  # another run's, which --overwrite replaces
    straight = _train(*run, "--steps", "3", "--save-every", "1", "--overwrite", "--report", str(tmp_path / "a.json"))
    assert straight.returncode == 0, straight.stderr
    assert "--overwrite: removed 2 checkpoint file(s)" in straight.stderr
    assert not ckpt.checkpoint_path(tmp_path / "ck", 0, 7).exists()
    assert ckpt.latest_step(tmp_path / "ck", world_size=2) == 3
    newest = ckpt.checkpoint_path(tmp_path / "ck", 1, 3)
    _flip_byte(newest)
    stale = tmp_path / "ck" / ".rank0-step00000004.pt.x1y2z3"
    stale.write_bytes(b"an interrupted write")
    resumed = _train(*run, "--steps", "3", "--resume", "--report", str(tmp_path / "b.json"))
    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert re.search(rf"warning: checkpoint {re.escape(str(newest))} is damaged \(sha256 differs from the "
                     r"manifest\): resuming from step 2", resumed.stderr), resumed.stderr
    assert not stale.exists()
    losses = [json.loads((tmp_path / f).read_text())["losses"] for f in ("a.json", "b.json")]
    assert losses[1] == losses[0][2:]  # step 3 again, from step 2's state, exactly


def test_resume_with_no_intact_checkpoint_and_a_used_directory_are_clear_errors(tmp_path, capsys):
    directory = tmp_path / "ck"
    for rank in (0, 1):
        _save(directory, rank, 2)
    _flip_byte(ckpt.checkpoint_path(directory, 0, 2))
    args = ["train", "--schedule", "1f1b", *SMALL, "--checkpoint", str(directory)]
    assert main([*args, "--resume", "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "rank0-step00000002.pt (sha256 differs" in err and "Traceback" not in err
    assert main([*args, "--steps", "4"]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint {str(directory)!r} already holds 4 checkpoint file(s)" in err and "--overwrite" in err
    assert main([*args, "--steps", "4", "--resume", "--overwrite"]) == 2
    assert "choose one" in capsys.readouterr().err
    assert len(ckpt.existing_files(directory)) == 4  # nothing was deleted
