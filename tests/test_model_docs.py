"""docs/your-model.md: its examples run as written and check themselves. The first, a
two-process pipeline, runs as a user runs it (saved to a file, `python file.py`)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "your-model.md"


def _blocks() -> list[str]:
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 3, f"{DOC.name} has {len(blocks)} ```python blocks"
    return blocks


@pytest.mark.spawn
def test_first_example_trains_a_custom_model_through_a_pipeline(tmp_path):
    script = tmp_path / "your_model.py"
    script.write_text(_blocks()[0])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+) over 30 steps", proc.stdout).groups())
    assert last < 0.5 * first


@pytest.mark.torch
def test_hugging_face_example_runs():
    pytest.importorskip("transformers", reason="the Hugging Face example needs transformers (pip install -e .[hf])")
    exec(compile(_blocks()[1], str(DOC), "exec"), {"__name__": "your_model_hf_example"})


@pytest.mark.torch
def test_split_example_runs(capsys):
    exec(compile(_blocks()[2], str(DOC), "exec"), {"__name__": "your_model_example"})
    out = capsys.readouterr().out
    assert "[range(0, 2), range(2, 4)]" in out and "['head.bias', 'head.weight']" in out
