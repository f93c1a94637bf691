"""docs/fine-tune.md runs as written: its first script makes a tiny model directory (nothing
is downloaded), its command fine-tunes it with `pipeblocks train --hf ... --save-hf tuned`,
and its last script loads the result with transformers and generates. Each step runs as a
user runs it, in a fresh directory; the training loss must fall and the held-out loss too."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawn
pytest.importorskip("transformers", reason="docs/fine-tune.md needs transformers (pip install -e .[hf])")

DOC = Path(__file__).resolve().parent.parent / "docs" / "fine-tune.md"


def _run(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_fine_tuning_guide_runs_as_written(tmp_path):
    text = DOC.read_text()
    make, generate = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    (command,) = re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    (tmp_path / "make_model.py").write_text(make)
    (tmp_path / "generate.py").write_text(generate)
    assert "parameters; notes.txt:" in _run([sys.executable, "make_model.py"], tmp_path)
    words = command.split()
    assert words[:2] == ["pipeblocks", "train"] and "--save-hf" in words
    out = _run([sys.executable, "-m", "pipeblocks.cli.main", *words[1:]], tmp_path)
    losses = [float(x) for x in re.findall(r"^step +\d+/\d+ +loss (\S+)", out, flags=re.M)]
    held = [float(x) for x in re.findall(r"held-out loss (\S+)", out)]
    assert losses[-1] < losses[0] - 1.0 and held[-1] < held[0], out
    assert {p.name for p in (tmp_path / "tuned").iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert _run([sys.executable, "generate.py"], tmp_path).startswith("The with statement")
