"""`torchrun -m pipeblocks train --tp 2`: p x tp = 4 processes started by torchrun verify one
step against one process (float64), and a world that is not p x dp x tp is refused."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spawn


def _torchrun_train(tmp_path, *options, nproc: int):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
         "-m", "pipeblocks", "train", *options],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )


def test_verify_at_p2_tp2_under_torchrun_and_a_world_that_does_not_fit(tmp_path):
    options = ("--model-family", "llama", "--schedule", "1f1b", "-p", "2", "--tp", "2", "-m", "2", "--layers", "2",
               "--hidden", "16", "--heads", "2", "--kv-heads", "2", "--seq", "8", "--microbatch-size", "1",
               "--precision", "fp64", "--verify")
    proc = _torchrun_train(tmp_path, *options, nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("tolerance 1e-10: OK") == 1 and "tp=2" in proc.stdout, proc.stdout
    bad = _torchrun_train(tmp_path, *options, nproc=2)
    assert bad.returncode != 0
    said = [line for line in bad.stderr.splitlines() if line.startswith("pipeblocks train: error:")]
    assert len(said) == 1 and "needs p x dp x tp = 4 processes but torchrun started 2" in said[0], bad.stderr[-2000:]
