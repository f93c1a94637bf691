"""`pipeblocks train --vocab-parallel`: the stages hold no embedding and no head, every rank
holds its rows of both as parameters of its optimizer, the executor runs the Program's IF,
S, T and IB passes, and `--verify` is exact in float64 against one process training the
unsplit model (the tables gathered back by their names are compared too), with data
parallelism as without."""
from __future__ import annotations

import re

import pytest

from pipeblocks.train.composition import Draft, check_composition

TINY = ("--model-family", "llama", "--layers", "8", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--seq", "8",
        "--precision", "fp64", "--timeout", "90", "--vocab-parallel")
VERIFIED = re.compile(r"loss ([\d.]+) vs one process ([\d.]+) .*; (\d+) gradients and weights .*largest relative "
                      r"difference ([\d.e+-]+), tolerance ([\d.e+-]+): OK", re.S)


@pytest.mark.parametrize("options, says", [
    (dict(model="gpt"), r"--vocab-parallel trains the built-in Llama and --hf models for now .* model gpt .* --hf DIR"),
    (dict(model="models/tiny.py:Tiny"), r"model models/tiny.py:Tiny is not split by vocabulary yet"),
    (dict(schedule="dualpipe"), r"--vocab-parallel with --schedule dualpipe is not supported: .* dualpipev"),
    (dict(tp=2), r"--vocab-parallel with --tp 2 is not supported: .* drop --tp"),
    (dict(async_mode="pipemare"), r"--vocab-parallel with --async is not supported"),
    (dict(seq_chunks=2), r"--vocab-parallel runs whole microbatches: drop --seq-chunks 2"),
    (dict(checkpoint=True), r"--vocab-parallel with --checkpoint/--resume is not supported yet"),
    (dict(save_hf=True), r"--vocab-parallel with --save-hf is not supported yet"),
    (dict(eval_every=2), r"--vocab-parallel with --eval-every 2 is not supported yet"),
    (dict(dry_run=True), r"--vocab-parallel with --dry-run is not supported yet"),
])
def test_what_vocab_parallel_does_not_compose_with_is_one_line(options, says):
    draft = dict(model="llama", schedule="1f1b", vocab_parallel=True)
    with pytest.raises(ValueError, match=says) as error:
        check_composition(Draft(**{**draft, **options}))
    assert "\n" not in str(error.value)


def test_vocab_parallel_composes_with_what_train_runs():
    for options in (dict(), dict(precision="bf16-mixed"), dict(clip_grad=1.0, recompute=True, verify=True),
                    dict(precision="bf16-mixed", verify=True),
                    dict(model="hf:models/qwen2", model_tied=True),
                    dict(split=True, schedule="v-half"), dict(dp=2, sharding=("zero3",)), dict(emulate=True)):
        check_composition(Draft(**{**dict(model="llama", schedule="1f1b", vocab_parallel=True), **options}))


@pytest.mark.spawn
def test_train_vocab_parallel_verify_is_exact_in_float64_at_p2_and_p4(tmp_path):
    from test_train import _train

    # a Hugging Face Qwen2 whose head is tied to its embedding, with Qwen2's own vocabulary
    # (151,936 rows at hidden 32) and tokens drawn over all of it: one shard of rows per rank
    # takes both passes' gradients, compared under both names with transformers' tied model
    pytest.importorskip("transformers", reason="Hugging Face models need transformers (pip install -e .[hf])")
    import numpy as np
    from _hf_dirs import make_model_dir

    vocab = 151_936
    tied = make_model_dir(tmp_path / "qwen2", "Qwen2ForCausalLM", tied=True, layers=4, vocab=vocab)
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, vocab, size=4096, dtype=np.uint32).tofile(tokens)
    hf = ("--hf", str(tied), "--data", str(tokens), "--data-dtype", "uint32", "--seq", "8", "--schedule", "zb-v",
          "-p", "2", "-m", "4", "--microbatch-size", "2", "--timeout", "90", "--vocab-parallel", "--verify")
    proc = _train(*hf, "--precision", "fp64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = VERIFIED.search(proc.stdout)
    assert match and float(match.group(4)) <= 1e-12, proc.stdout
    assert int(match.group(3)) == 4 * 12 + 3, proc.stdout  # q, k, v have biases in Qwen2
    # bf16-mixed: the gradients judged against float64, within one process's own rounding noise
    proc = _train(*hf, "--precision", "bf16-mixed")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"gradients against float64 .* excess -?[\d.e+-]+\)\nlargest relative difference [\d.e+-]+, "
                     r"tolerance 0.01: OK", proc.stdout), proc.stdout

    # p = 2 under 1F1B with two replicas (zero3: the stages sharded, the rows replicated, their
    # gradients averaged over dp); p = 4 under V-Half (two stages per rank, stage 0 and the last
    # on rank 0). V = 256 (bytes): 128 and 64 rows per rank
    for p, schedule, extra in ((2, "1f1b", ("--dp", "2", "--sharding", "zero3")), (4, "v-half", ())):
        proc = _train("--schedule", schedule, "-p", str(p), "-m", "4", "--microbatch-size", "2", *TINY, *extra,
                      "--verify")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        match = VERIFIED.search(proc.stdout)
        assert match, proc.stdout
        # 8 layers of 9 tensors, the final norm, the embedding and the head: all compared
        assert int(match.group(3)) == 8 * 9 + 3, proc.stdout
        assert float(match.group(4)) <= 1e-12, proc.stdout


@pytest.mark.torch
def test_vocab_parallel_cuts_equal_layers_per_rank():
    """No stage holds a vocabulary layer: without --split the layers are cut as simulate and plan
    cut them (the first L mod S stages one more), so every rank of a V placement holds 3 of 6."""
    from pipeblocks.resolve.request import Mesh, ScheduleRequest
    from pipeblocks.models.llama_config import LlamaConfig
    from pipeblocks.train.run import prepare

    model = LlamaConfig(layers=6, hidden=16, heads=2, kv_heads=1, seq=8, dtype="float64")
    request = ScheduleRequest(name="v-half", m=4, mesh=Mesh(pp=2))
    plain, _ = prepare(request, model=model, steps=1, microbatch_size=2)
    vocab, _ = prepare(request, model=model, steps=1, microbatch_size=2, vocab_parallel=True)
    assert plain.stage_layers == (1, 2, 2, 1) and not plain.schedule.vocab_parallel
    assert vocab.stage_layers == (2, 2, 1, 1) and vocab.schedule.vocab_parallel
