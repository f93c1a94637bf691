"""The device and the model a user asks for, checked before anything is launched: CUDA with
fewer GPUs than ranks (the GPU count faked), a precision the device cannot run, a model
family whose package is missing, sequence chunks for a family without them. One line and
exit status 2 each, never an NCCL traceback."""
from __future__ import annotations

import pytest
import torch

from pipeblocks.cli.main import main
from pipeblocks.runtime.launch import choose_device

pytestmark = pytest.mark.torch


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def one_gpu(monkeypatch):
    """This process sees one CUDA device (nothing is ever run on it here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_cuda_with_more_ranks_than_gpus_is_refused_in_one_line(capsys, one_gpu):
    code, out, err = run_cli(capsys, "train", "-p", "2", "--device", "cuda", "--steps", "1")
    assert code == 2 and out == ""
    line = err.strip()
    assert "\n" not in line, err
    assert "2 ranks" in line and "1 GPU" in line
    for fix in ("--device cpu", "fewer ranks", "torchrun"):
        assert fix in line, line
    assert "NCCL" in line and "Traceback" not in err


def test_dp_counts_every_local_rank(capsys, one_gpu):
    code, _, err = run_cli(capsys, "train", "-p", "2", "--dp", "2", "--device", "cuda", "--steps", "1")
    assert code == 2 and "4 ranks" in err and "1 GPU" in err


def test_auto_falls_back_to_the_cpu_and_says_why(one_gpu):
    notes = []
    assert choose_device("auto", 2, note=notes.append) == "cpu"
    assert len(notes) == 1 and "2 ranks but 1 GPU" in notes[0] and "CPU" in notes[0]
    assert choose_device("auto", 1, note=notes.append) == "cuda" and len(notes) == 1
    assert choose_device("cpu", 8) == "cpu"


def test_cuda_without_cuda_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_cli(capsys, "train", "-p", "2", "--device", "cuda", "--steps", "1")
    assert code == 2 and "CUDA is not available" in err and "--device cpu" in err


def test_bf16_on_a_gpu_without_bfloat16_is_refused(capsys, one_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Old GPU")
    code, _, err = run_cli(capsys, "train", "-p", "1", "--device", "cuda", "--precision", "bf16-mixed", "--steps", "1")
    assert code == 2 and "no bfloat16" in err and "--precision fp32" in err


def test_hf_llama_without_transformers_names_the_install_command(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    code, out, err = run_cli(capsys, "train", "--model-family", "hf-llama", "--steps", "1", "--dry-run")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "pip install -e .[hf]" in err


def test_sequence_chunks_need_a_family_that_runs_them(capsys):
    pytest.importorskip("transformers", reason="the hf-llama family needs transformers (pip install -e .[hf])")
    code, _, err = run_cli(capsys, "train", "--model-family", "hf-llama", "--seq-chunks", "2", "--steps", "1",
                           "--dry-run")
    assert code == 2 and "cannot run sequence chunks" in err and "--model-family llama" in err


def test_dtype_and_precision_must_agree(capsys):
    code, _, err = run_cli(capsys, "train", "--dtype", "float64", "--precision", "bf16-mixed", "--dry-run")
    assert code == 2 and "disagree" in err


def test_kv_heads_must_divide_heads(capsys):
    code, _, err = run_cli(capsys, "train", "--model-family", "llama", "--heads", "4", "--kv-heads", "3", "--dry-run")
    assert code == 2 and "kv_heads" in err.replace("-", "_").lower()


def test_verify_of_bf16_sequence_chunks_is_refused_with_the_exact_alternative(capsys):
    code, _, err = run_cli(capsys, "train", "--model-family", "llama", "--precision", "bf16-mixed", "--seq-chunks", "2",
                           "--verify")
    assert code == 2 and "--precision fp64" in err and "without --seq-chunks" in err
