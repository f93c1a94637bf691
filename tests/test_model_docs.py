"""docs/your-model.md: its examples run as written and check themselves. The first, a
user's ModelSpec, is saved as my_model.py and trained by the doc's own commands
(`pipeblocks train --model my_model.py:SPEC`: 2 pipeline ranks x 2 replicas in bf16-mixed,
then --verify in float64); the second, a two-process pipeline driven by hand, runs as a
user runs it (saved to a file, `python file.py`)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "your-model.md"


def _blocks(kind: str = "python") -> list[str]:
    blocks = re.findall(rf"^```{kind}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    assert len(blocks) >= (4 if kind == "python" else 1), f"{DOC.name} has {len(blocks)} ```{kind} blocks"
    return blocks


@pytest.mark.spawn
def test_first_example_is_a_spec_that_pipeblocks_train_trains(tmp_path):
    (tmp_path / "my_model.py").write_text(_blocks()[0])
    train, verify = [line for line in _blocks("bash")[0].splitlines() if line.startswith("pipeblocks train")]
    assert "--dp 2" in train and "bf16-mixed" in train and "--verify" in verify
    for command in (train, verify):
        args = [sys.executable, "-m", "pipeblocks.cli.main", *command.split()[1:]]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        if command is train:
            losses = [float(x) for x in re.findall(r"^step +\d+/20 +loss (\S+)", proc.stdout, flags=re.M)]
            assert len(losses) == 20 and losses[-1] < 0.8 * losses[0], proc.stdout
        else:
            assert "tolerance 1e-10: OK" in proc.stdout, proc.stdout


@pytest.mark.spawn
def test_runner_example_trains_a_custom_model_through_a_pipeline(tmp_path):
    script = tmp_path / "your_model.py"
    script.write_text(_blocks()[1])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+) over 30 steps", proc.stdout).groups())
    assert last < 0.5 * first


@pytest.mark.torch
def test_hugging_face_example_runs():
    pytest.importorskip("transformers", reason="the Hugging Face example needs transformers (pip install -e .[hf])")
    exec(compile(_blocks()[2], str(DOC), "exec"), {"__name__": "your_model_hf_example"})


@pytest.mark.torch
def test_split_example_runs(capsys):
    exec(compile(_blocks()[3], str(DOC), "exec"), {"__name__": "your_model_example"})
    out = capsys.readouterr().out
    assert "[range(0, 2), range(2, 4)]" in out and "['head.bias', 'head.weight']" in out
