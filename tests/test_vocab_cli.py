"""--vocab-parallel on simulate and compare: the balance the issue asks for on the
128k-vocabulary Llama-3-8B shape at p=8, and the refusals."""
from __future__ import annotations

import json

import pytest

from pipeblocks.cli.main import main


def _simulate(capsys, *argv):
    code = main(["simulate", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    data = json.loads(out)
    need = [a + s for a, s in zip(data["peak_activation"], data["static_memory_peak"])]
    return data["makespan"], need


@pytest.mark.parametrize("name", ["zb-v", pytest.param("v-half", marks=pytest.mark.sweep)])
def test_llama3_8b_p8_balanced_and_faster(capsys, name):
    base = (name, "-p", "8", "-m", "32", "--model", "llama-3-8b")
    naive, _ = _simulate(capsys, *base)
    split, _ = _simulate(capsys, *base, "--split", "auto")
    vocab, need = _simulate(capsys, *base, "--vocab-parallel")
    assert max(need) <= 1.10 * min(need)  # largest rank's peak within 10% of the smallest's
    assert vocab < naive and vocab < split


def test_compare_skips_what_it_cannot_place(capsys):
    code = main(["compare", "-p", "2", "-m", "4", "--model", "llama-3-8b", "--vocab-parallel"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "zb-v" in out and "skipped seq1f1b: --vocab-parallel runs whole microbatches" in out


@pytest.mark.parametrize("argv,message", [
    (["1f1b", "-p", "2", "-m", "4", "--vocab-parallel"], "--vocab-parallel prices the embedding and the head"),
    (["1f1b", "-p", "2", "-m", "4", "--model", "llama-3-8b", "--vocab-parallel", "--tp", "2"],
     "--vocab-parallel with --tp 2"),
])
def test_refusals(capsys, argv, message):
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and message in err and "Traceback" not in err


def test_train_refuses_a_model_it_does_not_split_yet(capsys):
    """train runs --vocab-parallel on the built-in Llama and --hf models; the GPT (the default family) is refused in one line."""
    code = main(["train", "--schedule", "1f1b", "-p", "2", "-m", "2", "--steps", "1", "--vocab-parallel"])
    out, err = capsys.readouterr()
    assert code == 2 and "--vocab-parallel trains the built-in Llama and --hf models for now" in err and "Traceback" not in err


def test_show_program_holds_the_passes_and_export_refuses(capsys):
    base = ["1f1b", "-p", "2", "-m", "2", "--model", "llama-3-8b", "--vocab-parallel"]
    assert main(["show", *base, "--program"]) == 0
    out, _ = capsys.readouterr()
    assert "IF0" in out and "S1" in out and "IB1" in out
    code = main(["export", *base])
    out, err = capsys.readouterr()
    assert code == 2 and "torch's CSV and the schedule's text and JSON hold no vocabulary passes" in err


def test_default_split_balances_ranks_without_vocabulary_layers(capsys):
    # 80 layers over 32 stages: the even rule's lighter end stages would leave rank 0 (stages 0
    # and 31 under V placement) with 4 layers against 5; balanced per rank every rank holds 5
    assert main(["simulate", "zb-v", "-p", "16", "-m", "32", "--model", "llama-3-70b", "--vocab-parallel"]) == 0
    out, _ = capsys.readouterr()
    line = next(x for x in out.splitlines() if x.startswith("split"))
    counts = [int(c) for c in line.split()[1].split(",")]
    assert "balanced per rank" in line
    assert {counts[r] + counts[31 - r] for r in range(16)} == {5}


def test_simulate_names_the_passes(capsys):
    assert main(["simulate", "1f1b", "-p", "4", "-m", "8", "--model", "llama-3-8b", "--vocab-parallel"]) == 0
    out, _ = capsys.readouterr()
    line = next(x for x in out.splitlines() if x.startswith("vocabulary"))
    assert "one barrier" in line and "one more microbatch in flight" in line
    assert len(line.split("time per rank ")[1].split(";")[0].split()) == 4


def test_hf_config_with_a_large_tied_vocabulary(capsys, tmp_path):
    # a Qwen2-1.5B-shaped config.json (152k vocabulary, tied tables): priced without weights
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 1536,
        "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "torch_dtype": "bfloat16"}))
    base = ("zb-v", "-p", "4", "-m", "16", "--hf", str(tmp_path / "config.json"))
    naive, naive_need = _simulate(capsys, *base)
    vocab, need = _simulate(capsys, *base, "--vocab-parallel")
    assert vocab < naive
    assert max(need) / min(need) < max(naive_need) / min(naive_need)
