"""The torchrun path: environment rendezvous, one process per rank, the example script."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchrun_gpt.py"


def test_example_trains_under_torchrun(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLE), "--schedule", "zb-v", "--microbatches", "4", "--steps", "3"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 3
    assert losses[0] == pytest.approx(5.5532, abs=1e-3)  # the untrained byte-level model: ~ln(256)
    assert losses[-1] < losses[0]
