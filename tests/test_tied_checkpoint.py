"""Checkpoints of a model whose head is tied to its embedding hold the weight once (the first
stage's), and a resumed run copies it back to the last stage: 2 steps, a checkpoint, 2 more
steps after --resume give the losses of 4 steps straight (float64, bit for bit), with
per-rank checkpoints at p = 2 and with torch.distributed.checkpoint at p = 2 x dp = 2 zero3."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from _hf_dirs import make_model_dir

pytestmark = pytest.mark.spawn
pytest.importorskip("transformers", reason="needs transformers (pip install -e .[hf])")


def _losses(args: list[str], cwd) -> list[float]:
    proc = subprocess.run([sys.executable, "-m", "pipeblocks.cli.main", "train", *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [float(x) for x in re.findall(r"^step +\d+/\d+ +loss (\S+)", proc.stdout, flags=re.M)]


@pytest.mark.parametrize("mesh", [[], ["--dp", "2", "--sharding", "zero3"]], ids=["per-rank", "dcp-zero3"])
def test_a_resumed_tied_model_continues_exactly(tmp_path, mesh):
    import torch

    directory = make_model_dir(tmp_path / "qwen2", "Qwen2ForCausalLM", tied=True)
    base = ["--hf", str(directory), "--schedule", "1f1b", "-p", "2", "-m", "2", "--seq", "16", "--precision", "fp64",
            "--microbatch-size", "2", "--lr-decay-steps", "4", *mesh]
    straight = _losses([*base, "--steps", "4"], tmp_path)
    first = _losses([*base, "--steps", "2", "--checkpoint", str(tmp_path / "ck")], tmp_path)
    then = _losses([*base, "--steps", "4", "--checkpoint", str(tmp_path / "ck"), "--resume"], tmp_path)
    assert first + then == straight
    if not mesh:  # the last stage's file holds no copy of the tied weight
        from pipeblocks.train.checkpoint import checkpoint_path

        last = torch.load(checkpoint_path(tmp_path / "ck", 1, 4), weights_only=False)["stages"][1]
        assert "lm_head.weight" not in last and "model.norm.weight" in last
