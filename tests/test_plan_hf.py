"""`pipeblocks plan --hf DIR` on a tiny model directory prints a `pipeblocks train --hf DIR`
command, and that command runs as printed (with a short --steps added), on the model the
plan priced: the run's header names the directory's architecture and sizes."""
from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from _hf_dirs import make_model_dir

pytestmark = pytest.mark.spawn
pytest.importorskip("transformers", reason="needs transformers (pip install -e .[hf])")


def _pipeblocks(args: list[str], cwd) -> str:
    proc = subprocess.run([sys.executable, "-m", "pipeblocks.cli.main", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_printed_train_command_of_a_tiny_directory_runs(tmp_path):
    directory = make_model_dir(tmp_path / "qwen2", "Qwen2ForCausalLM", tied=True)
    out = _pipeblocks(["plan", "--hf", str(directory), "--gpus", "2", "--gpu-memory", "1", "--global-batch", "8",
                       "--seq", "32", "--schedules", "1f1b,v-half", "--microbatch-sizes", "1,2", "--top", "1",
                       "--jobs", "1"], tmp_path)
    command = next(line.strip() for line in out.splitlines() if line.strip().startswith("pipeblocks train"))
    words = shlex.split(command)
    assert words[words.index("--hf") + 1] == str(directory) and "--layers" not in words and "--seq" in words
    run = _pipeblocks([*words[1:], "--steps", "2", "--quiet"], tmp_path)
    assert run.startswith("training 4-layer Qwen2ForCausalLM (hidden 32, 4 heads, 2 KV heads, tied embeddings)"), run
