"""The weights back out: a run of a Hugging Face directory on a p = 2 x dp = 2 zero3 mesh
writes `--save-hf OUT`, which transformers loads, and whose loss on the held-out batch equals
the pipeline's own held-out loss after the last step (float64, the ranks' evaluation through
the sharded stages), its memory measured within 5% of the prediction on every rank;
`pipeblocks export --hf` of the run's data-parallel checkpoint writes
the same tensors, sharded with an index when asked; a tied head is written once. The
built-in Llama exports as transformers' LlamaForCausalLM."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _hf_dirs import make_model_dir

pytestmark = pytest.mark.spawn
transformers = pytest.importorskip("transformers", reason="needs transformers (pip install -e .[hf])")

SEQ, M, B = 16, 2, 2


def _pipeblocks(*args: str, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pipeblocks.cli.main", *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _held_out_loss(model_dir, data_dir, *, dtype) -> float:
    """The held-out loss of transformers' own model of `model_dir`, on the batch the ranks evaluate."""
    import torch

    from pipeblocks.models.spec import cross_entropy
    from pipeblocks.train.config import DataSpec
    from pipeblocks.train.corpus import load_corpus

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    corpus = load_corpus(DataSpec(), seq=SEQ, vocab=model.config.vocab_size, model_tokenizer=str(data_dir))
    _, held = corpus.split(0.05)
    inputs, targets = held.eval_batch(M * B)
    with torch.no_grad():
        losses = [cross_entropy(model(x).logits, y).item() for x, y in zip(inputs.chunk(M), targets.chunk(M))]
    return sum(losses) / M


def test_save_hf_and_export_of_a_tied_model_at_p2_dp2_zero3(tmp_path):
    import torch
    from safetensors import safe_open

    source = make_model_dir(tmp_path / "qwen2", "Qwen2ForCausalLM", tied=True)
    out, ckpt, exported = tmp_path / "out", tmp_path / "ckpt", tmp_path / "exported"
    _pipeblocks("train", "--hf", str(source), "--schedule", "1f1b", "-p", "2", "-m", str(M), "--dp", "2",
                "--sharding", "zero3", "--precision", "fp64", "--seq", str(SEQ), "--microbatch-size", str(B),
                "--steps", "3", "--eval-every", "3", "--checkpoint", str(ckpt), "--save-hf", str(out),
                "--report", str(tmp_path / "run.json"), "--quiet", cwd=tmp_path)
    report = json.loads((tmp_path / "run.json").read_text())
    pipeline_loss = report["eval_losses"][-1]["loss"]
    for rank in report["ranks"]:  # the memory model prices the directory's model as it prices the built-ins
        for what in ("peak_activation_bytes", "static_bytes"):
            measured, predicted = rank[f"{what}_measured"], rank[f"{what}_predicted"]
            assert abs(measured - predicted) <= 0.05 * measured, (rank, what)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.json", "tokenizer_config.json"]
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # the tied weight once
    loss = _held_out_loss(out, source, dtype=torch.float64)
    assert loss == pytest.approx(pipeline_loss, rel=1e-10)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # the same run's checkpoint (DCP, zero3 shards), exported stage by stage, sharded by size
    _pipeblocks("export", "--hf", str(ckpt), str(exported), "--max-shard-gb", "0.00002", cwd=tmp_path)
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    files = sorted({f for f in index["weight_map"].values()})
    assert len(files) > 1 and all((exported / f).is_file() for f in files) and set(index["weight_map"]) == names
    for name in names:
        with safe_open(str(out / "model.safetensors"), "pt") as a, safe_open(
                str(exported / index["weight_map"][name]), "pt") as b:
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
    assert _held_out_loss(exported, source, dtype=torch.float64) == loss


def test_the_built_in_llama_exports_as_llama_for_causal_lm(tmp_path):
    import torch

    from pipeblocks.models import build_model, get_family

    out = tmp_path / "out"
    _pipeblocks("train", "--model-family", "llama", "--layers", "2", "--hidden", "16", "--heads", "4", "--kv-heads", "2",
                "--schedule", "1f1b", "-p", "2", "-m", "2", "--seq", "16", "--precision", "fp64", "--steps", "1",
                "--quiet", "--save-hf", str(out), cwd=tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float64).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and not (out / "tokenizer.json").exists()  # bytes: no files
    family = get_family("llama")
    cfg = family.config(layers=2, hidden=16, heads=4, kv_heads=2, seq=16, vocab=256, dtype="float64")
    ours = build_model(family.spec(cfg), seed=0)  # the run's starting weights: one step moved them
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(tokens).logits
        start = ours(tokens)
        for name, param in ours.named_parameters():  # load the exported weights into the built-in model
            from pipeblocks.models.hf_llama import llama_hf_name

            param.copy_(dict(model.named_parameters())[llama_hf_name(name)])
        trained = ours(tokens)
    assert (trained - start).abs().max() > 1e-6  # the export holds the trained weights, not the starting ones
    # transformers' RMSNorm normalises in float32 whatever the dtype: agreement to float32's rounding
    torch.testing.assert_close(theirs, trained, rtol=1e-5, atol=1e-5)
