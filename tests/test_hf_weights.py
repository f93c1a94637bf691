"""Each rank reads only its own stages' tensors from a Hugging Face directory's safetensors,
and under tensor parallelism only its slices of them: stage 0 of 2 reads the embedding and
its blocks, nothing of the other stage; with tp = 2 each rank reads the half of a
column-split projection's rows (and of the embedding's rows) that it holds, whole norms,
and its shards equal those slices of the file's tensors."""
from __future__ import annotations

import pytest

from _hf_dirs import make_model_dir
from _tp_reads import RecordingWeights

pytest.importorskip("transformers", reason="needs transformers (pip install -e .[hf])")


@pytest.mark.torch
def test_a_rank_reads_only_its_stages_tensors(tmp_path):
    import dataclasses

    from pipeblocks.models import build_stages
    from pipeblocks.models.hf import hf_spec

    directory = make_model_dir(tmp_path / "llama", "LlamaForCausalLM", layers=4, tokenizer=False)
    spec = hf_spec(directory)
    recording = RecordingWeights(spec.weights)
    build_stages(dataclasses.replace(spec, weights=recording), num_stages=2, stages=[0])
    names = [name for name, _ in recording.reads]
    assert names[0] == "model.embed_tokens.weight"
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"0", "1"}
    assert not any(n.startswith(("model.layers.2", "model.layers.3", "lm_head", "model.norm")) for n in names)


@pytest.mark.spawn
def test_a_tensor_parallel_rank_reads_only_its_slices(tmp_path):
    from safetensors import safe_open

    from pipeblocks.runtime import spawn

    from _tp_reads import read_as_tp_rank

    directory = make_model_dir(tmp_path / "llama", "LlamaForCausalLM", layers=2, tokenizer=False, dtype="float64")
    per_rank = spawn(read_as_tp_rank, 2, args=(str(directory), 2, 0), timeout_s=120, threads_per_rank=1)
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        whole = {name: handle.get_tensor(name) for name in handle.keys()}
    for rank, (reads, local) in enumerate(per_rank):
        regions = dict(reads)
        q = regions["model.layers.0.self_attn.q_proj.weight"]  # 32 rows (4 heads x 8), column-split by rows
        assert q == ((16 * rank, 16 * rank + 16), (0, 32))
        assert regions["model.embed_tokens.weight"] == ((160 * rank, 160 * rank + 160), (0, 32))  # vocabulary 320
        assert regions["model.layers.0.input_layernorm.weight"] == ((0, 32),)  # a norm is whole on every rank
        for name, shard in local.items():
            region = tuple(slice(a, b) for a, b in regions[name])
            assert shard.equal(whole[name][region]), name
