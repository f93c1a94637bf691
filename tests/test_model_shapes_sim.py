"""The simulator, the memory model and the planner price the models users train: grouped-query
attention, a head width of its own, SwiGLU, the vocabulary's embedding and head, tied
embeddings, RMSNorm and rotary positions; presets shaped like Llama-3 and Qwen2.5; `--hf`.
The reference GPT's figures stay what the old formulas gave."""
from __future__ import annotations

import dataclasses
import json
import math
import shlex

import pytest

from pipeblocks.cli.main import build_parser, main
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.core.cost.model_shape import ModelShape
from pipeblocks.core.cost.hf_config import read_hf_config
from pipeblocks.resolve.request import CostSpec
from pipeblocks.plan import PlanProblem
from pipeblocks.plan.intensity import layer_efficiency
from pipeblocks.plan.search import model_flops
from pipeblocks.plan.space import meshes
from pipeblocks.sim.analytic import (
    HARDWARE, MODELS, TransformerConfig, head_flops, layer_activation_bytes, layer_flops, layer_gemms,
    layer_intensity, loss_activation_bytes, model_from_hf, rotary_table_bytes, sequence_flops, stage_activation_bytes,
    stage_params, transformer_costs, transformer_w_ratio,
)
from pipeblocks.sim.blocks import transformer_blocks
from pipeblocks.resolve.build import model_config, resolve_costs
from pipeblocks.sim.memory_estimate import stage_param_shapes
from pipeblocks.sim.sequence_split import balanced_split, chunk_flops
from pipeblocks.sim.tp_memory import tp_layer_activation_bytes, tp_mismatch

approx = pytest.approx

# the public config.json of Meta-Llama-3-8B, as a plain dict
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def _prod(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@pytest.fixture
def llama_json(tmp_path):
    path = tmp_path / "Llama-3-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA_3_8B))
    return path


# ---- the reference GPT: the old formulas, written out -------------------------------------------------

@pytest.mark.parametrize("flash, dropout, dtype", [(True, False, "fp32"), (False, True, "bf16"), (True, True, "bf16")])
def test_gpt_figures_are_the_old_formulas(flash, dropout, dtype):
    L, h, a, s, V, b = 8, 64, 4, 64, 256, 2
    config = TransformerConfig(layers=L, hidden=h, heads=a, seq=s, vocab=V, microbatch_size=b, dtype=dtype,
                               flash_attention=flash, dropout=dropout)
    e = config.dtype_bytes
    f = max(4, e)
    # parameters: 12h^2 + 13h per layer, (V + s)h on the first stage, 2h + hV on the last
    layer = 12 * h * h + 13 * h
    assert stage_params(config, 4) == (2 * layer + (V + s) * h, 2 * layer, 2 * layer, 2 * layer + 2 * h + h * V)
    assert stage_params(config, 1) == (L * layer + (V + s) * h + 2 * h + h * V,)
    # FLOPs: F = s*b*h*(24h + 4s), B = s*b*h*(24h + 8s), W = 24*s*b*h^2; the head 2*s*b*h*V
    assert layer_flops(config) == (s * b * h * (24 * h + 4 * s), s * b * h * (24 * h + 8 * s), 24 * s * b * h * h)
    assert head_flops(config) == 2 * s * b * h * V
    hw = HARDWARE["h100"]  # one achievable fraction for every kernel
    rate = hw.flops * hw.efficiency
    costs = transformer_costs(config, hw, num_stages=4, stage0_input_grad=True)
    # the last stage's softmax cross entropy streams the logits: in F read twice, the fp32 log-probabilities written
    softmax_f = s * b * V * (2 * e + f) / hw.memory_bandwidth
    assert costs.t_f == approx((2 * s * b * h * (24 * h + 4 * s) / rate,) * 3
                               + ((2 * s * b * h * (24 * h + 4 * s) + 2 * s * b * h * V) / rate + softmax_f,), rel=1e-12)
    assert costs.t_b[3] - costs.t_b[2] == approx(2 * s * b * h * V / rate + s * b * V * (f + e) / hw.memory_bandwidth,
                                                 rel=1e-9)
    assert costs.t_w[1] == approx(2 * 24 * s * b * h * h / rate, rel=1e-12)
    # activations: 16he + 4f + (flash: af, else a*s*e) + dropout 2h (+ a*s*(1 + e)) per token and layer
    per_token = 16 * h * e + 4 * f + (a * f if flash else a * s * e)
    if dropout:
        per_token += 2 * h + (0 if flash else a * s * (1 + e))
    m_layer = s * b * per_token
    loss = s * b * (V * f + 8) + e
    embed = 8 * s * b + 8 * s + (s * b * h if dropout else 0)
    assert stage_activation_bytes(config, 4) == (2 * m_layer + embed, 2 * m_layer, 2 * m_layer,
                                                 2 * m_layer + s * b * (2 * h * e + 2 * f) + loss)
    assert loss_activation_bytes(config) == loss
    assert transformer_w_ratio(config) == 16 * s * b * h * e / m_layer
    if dropout and not flash and e == 2:  # Megatron's 34h + 5as, plus the LayerNorm statistics
        assert layer_activation_bytes(config, s, s) == s * b * (34 * h + 5 * a * s) + 16 * s * b
    sides = ((h, 3 * h), (h, h), (h, 4 * h), (4 * h, h))
    rows = s * b
    assert layer_intensity(config) == (sum(2 * rows * k * n for k, n in sides)
                                       / (e * sum(rows * k + k * n + rows * n for k, n in sides)))
    # the 4h MLP's GEMMs, the fused QKV: the reference GPT's parameter tensors
    assert stage_param_shapes(config, 4)[1][:12] == ((h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,),
                                                      (4 * h, h), (4 * h,), (h, 4 * h), (h,))


def test_gpt_presets_keep_their_figures():
    config = MODELS["1.5b"]
    L, h, a, s, V, b = 22, 2304, 24, 1024, 51200, 6
    assert config.shape == ModelShape(layers=L, hidden=h, heads=a, vocab=V, context=s)
    assert sum(stage_params(config, 8)) == L * (12 * h * h + 13 * h) + (V + s) * h + 2 * h + h * V
    assert sequence_flops(config) == approx(72 * s * h * h * L * (1 + s / (6 * h) + V / (12 * h * L)), rel=1e-12)
    problem = PlanProblem(model=config, hardware=HARDWARE["a100-80g"], gpus=8, gpu_memory=80e9, global_batch=16)
    assert model_flops(problem) == 16 * (L * s * h * (72 * h + 12 * s) + 6 * s * h * V)
    assert chunk_flops(0, s, config) == 4 * s * h * V + L * ((4 * (h // a) + 3) * a * (s * s - s * s / 2)
                                                             + 8 * s * h * h + 4 * s * h * 4 * h)
    assert layer_activation_bytes(config, s, s) == s * b * (34 * h + 5 * a * s) + 16 * s * b


# ---- shapes ---------------------------------------------------------------------------------------------

def test_a_model_shape_and_a_config_convert_both_ways():
    shapes = [
        MODELS["llama-3-8b"].shape,
        ModelShape(layers=4, hidden=96, heads=4, vocab=500, kv_heads=2, head_dim=32, ffn=200, mlp="swiglu",
                   norm="rmsnorm", positions="rotary", tied=True, linear_bias=False, qk_norm=True),  # Qwen3-like
        ModelShape(layers=8, hidden=64, heads=4, vocab=256, context=64),  # the reference GPT
    ]
    for shape in shapes:
        config = TransformerConfig.from_shape(shape, seq=64, microbatch_size=2)
        assert config.shape == shape and config.seq == 64 and config.microbatch_size == 2 and not config.dropout
        assert TransformerConfig.from_shape(config.shape, seq=64, microbatch_size=2) == config
    with pytest.raises(ScheduleError, match="seq 128 is longer than the learned position table's 64 rows"):
        TransformerConfig.from_shape(shapes[2], seq=128)
    with pytest.raises(ScheduleError, match="kv_heads \\(3\\) must divide heads \\(4\\)"):
        TransformerConfig(layers=2, hidden=64, heads=4, seq=8, kv_heads=3)


def test_the_presets_are_the_public_configs():
    llama = MODELS["llama-3-8b"]
    assert llama.shape.total_params() == 8_030_261_248  # Meta-Llama-3-8B
    assert sum(stage_params(llama, 4)) == llama.shape.total_params()
    assert MODELS["llama-3-70b"].shape.total_params() == approx(70.55e9, rel=1e-3)
    assert MODELS["qwen2.5-7b"].shape.total_params() == approx(7.62e9, rel=1e-3)  # q/k/v biases included
    for name in ("llama-3-8b", "llama-3-70b", "qwen2.5-7b"):
        config = MODELS[name]
        assert config.seq == 4096 and not config.dropout and not config.fused_qkv
        assert sum(_prod(x) for stage in stage_param_shapes(config, 4) for x in stage) == sum(stage_params(config, 4))


def test_the_last_stage_of_llama_3_8b_pays_for_the_128k_head():
    config = dataclasses.replace(MODELS["llama-3-8b"], flash_attention=True)
    s, h, V, f_m, d = 4096, 4096, 128256, 14336, 128
    assert transformer_blocks(config, num_stages=4).counts == (8, 8, 8, 8)
    # time: 8 layers against 8 layers, the head's 2*s*h*V in each pass and, in F, the softmax cross
    # entropy reading the bf16 logits twice and writing fp32 log-probabilities at the memory's bandwidth
    hw = HARDWARE["h100"]
    costs = transformer_costs(config, hw, num_stages=4)
    forward = 2 * s * config.shape.layer_weights() + 4 * s * s * h
    softmax = s * V * (2 * 2 + 4) / hw.memory_bandwidth * hw.flops * hw.efficiency  # in FLOPs at the GEMMs' rate
    time_ratio = 1 + (2 * s * h * V + softmax) / (8 * forward)
    assert costs.t_f[3] / costs.t_f[1] == approx(time_ratio, rel=1e-12) and time_ratio == approx(1.29, abs=0.01)
    # activation: the final norm's input, output and statistic, and the fp32 log-probabilities
    e, f = 2, 4
    per_token = (4 * h + 2 * h + 2 * 1024 + 4 * f_m) * e + 2 * f + 32 * f
    layer = s * per_token
    mem = stage_activation_bytes(config, 4)
    rotary = 2 * s * d * e
    assert mem[1] == 8 * layer + rotary and mem[0] == mem[1] + 8 * s
    memory_ratio = 1 + (s * (2 * h * e + f) + s * (V * 4 + 8) + e) / (8 * layer + rotary)
    assert mem[3] / mem[1] == approx(memory_ratio, rel=1e-12) and memory_ratio == approx(1.39, abs=0.01)
    # parameters: the final RMSNorm and the untied head
    params = stage_params(config, 4)
    assert params[3] - params[1] == h + h * V and params[0] - params[1] == V * h
    assert params[3] / params[1] == approx(1.30, abs=0.01)


def test_grouped_query_attention_saves_k_v_activation_and_parameters():
    mha = TransformerConfig(layers=4, hidden=256, heads=8, seq=128, vocab=1000, mlp="swiglu", norm="rmsnorm",
                            positions="rotary", linear_bias=False, ffn=688, flash_attention=True, dropout=False)
    gqa = dataclasses.replace(mha, kv_heads=2)
    d, e, tokens = 32, 2, 128
    saved = layer_activation_bytes(mha, tokens, tokens) - layer_activation_bytes(gqa, tokens, tokens)
    assert saved == tokens * 2 * (8 - 2) * d * e  # K and V at 2 heads instead of 8
    assert layer_activation_bytes(mha, tokens, tokens, kv=False) == layer_activation_bytes(gqa, tokens, tokens, kv=False)
    assert mha.shape.layer_params() - gqa.shape.layer_params() == 2 * 256 * (8 - 2) * d
    flops = [x - y for x, y in zip(layer_flops(mha), layer_flops(gqa))]
    assert flops == [2 * tokens * 2 * 256 * (8 - 2) * d] * 3  # the k and v products only; attention runs on 8 heads
    # the block's GEMMs are its matrices: separate q, k, v, o, gate, up, down
    assert layer_gemms(gqa) == ((256, 256), (256, 64), (256, 64), (256, 256), (256, 688), (256, 688), (688, 256))
    assert sum(k * n for k, n in layer_gemms(gqa)) == gqa.shape.layer_weights()
    # SwiGLU saves four f-wide tensors, RMSNorm one statistic per norm
    assert layer_activation_bytes(gqa, tokens, tokens) == tokens * ((4 * 256 + 2 * 256 + 2 * 64 + 4 * 688) * e
                                                                    + 2 * 4 + 8 * 4)
    # a sequence split balances the same FLOPs
    lengths = balanced_split(128, 4, gqa)
    bounds = [sum(lengths[:i]) for i in range(5)]
    chunks = [chunk_flops(x, y, gqa) for x, y in zip(bounds, bounds[1:])]
    assert sum(lengths) == 128 and max(chunks) / min(chunks) < 1.1


def test_a_tied_head_counts_once_in_the_model_and_on_both_end_stages():
    shape = ModelShape(layers=4, hidden=64, heads=4, vocab=1000, kv_heads=2, head_dim=32, ffn=176, mlp="swiglu",
                       norm="rmsnorm", positions="rotary", tied=True, linear_bias=False, qkv_bias=True)
    config = TransformerConfig.from_shape(shape, seq=32)
    params = stage_params(config, 2)
    assert sum(params) == shape.total_params() + 64 * 1000  # each end stage holds its copy
    shapes = stage_param_shapes(config, 2)
    assert shapes[0][0] == (1000, 64) and shapes[1][-1] == (1000, 64)
    assert [sum(_prod(x) for x in stage) for stage in shapes] == list(params)
    # one stage holds the one tensor
    assert stage_params(config, 1) == (shape.total_params(),)
    assert sum(_prod(x) for x in stage_param_shapes(config, 1)[0]) == shape.total_params()
    assert sum(transformer_blocks(config, num_stages=1).params[0]) == shape.total_params()
    # the head's compute is the same tied or not
    untied = dataclasses.replace(config, tied=False)
    assert transformer_costs(config, HARDWARE["h100"], num_stages=2) == dataclasses.replace(
        transformer_costs(untied, HARDWARE["h100"], num_stages=2), params=tuple(float(x) for x in params))
    # q of a*d = 128 differs from h = 64; q, k, v carry biases
    assert shapes[0][1:9] == ((64,), (128, 64), (128,), (64, 64), (64,), (64, 64), (64,), (64, 128))


def test_tensor_parallel_splits_the_heads_kv_heads_mlp_and_vocabulary():
    config = dataclasses.replace(MODELS["llama-3-8b"], flash_attention=True)
    shapes = stage_param_shapes(config, 4, tp=2)
    assert shapes[1][:8] == ((4096,), (2048, 4096), (512, 4096), (512, 4096), (4096, 2048), (4096,),
                             (7168, 4096), (7168, 4096))
    assert shapes[0][0] == (64128, 4096) and shapes[3][-1] == (64128, 4096)
    whole = sum(stage_params(config, 4))
    norms = 2 * 4096 * 32 + 4096  # whole on every rank
    assert 2 * sum(_prod(x) for stage in shapes for x in stage) == whole + norms
    # per token: 2he whole, the rest of one rank's 1/t
    e, f, h = 2, 4, 4096
    assert tp_layer_activation_bytes(config, 2) == 4096 * (2 * h * e + (2 * h + 2 * 4096 + 2 * 1024 + 4 * 14336) * e / 2
                                                           + (2 + 32) * f / 2)
    qwen = MODELS["qwen2.5-7b"]
    assert tp_mismatch(qwen, 4) is None and tp_mismatch(qwen, 8) == ("heads", 28)
    with pytest.raises(ValueError, match="tp 8 does not divide the model's heads \\(28\\)"):
        stage_param_shapes(qwen, 4, tp=8)
    problem = PlanProblem(model=qwen, hardware=HARDWARE["a100-80g"], gpus=16, gpu_memory=80e9, global_batch=64)
    assert {shape.tp for shape in meshes(problem)} == {1, 2, 4}
    assert layer_efficiency(config, HARDWARE["a100-80g"], 2) < layer_efficiency(config, HARDWARE["a100-80g"], 1)


# ---- --hf -----------------------------------------------------------------------------------------------

def test_hf_prices_like_the_preset(llama_json, capsys):
    assert read_hf_config(llama_json.parent).shape == MODELS["llama-3-8b"].shape
    assert model_from_hf(str(llama_json)) == MODELS["llama-3-8b"]  # seq min(context 8192, 4096)
    assert model_from_hf(str(llama_json), seq=2048, microbatch_size=2).seq == 2048
    spec = CostSpec(hf=str(llama_json.parent), flash_attention=True)
    preset = CostSpec(model="llama-3-8b", flash_attention=True)
    for tp in (1, 2):
        assert resolve_costs(spec, 4, tp=tp) == resolve_costs(preset, 4, tp=tp)
    assert model_config(CostSpec(hf=str(llama_json), seq=1024, microbatch_size=2)) == dataclasses.replace(
        MODELS["llama-3-8b"], seq=1024, microbatch_size=2)
    assert rotary_table_bytes(model_config(spec)) == 2 * 4096 * 128 * 2
    outputs = []
    for source in (["--hf", str(llama_json)], ["--model", "llama-3-8b"]):
        assert main(["simulate", "1f1b", "-p", "4", "-m", "8", *source, "--flash-attention", "--seq", "2048",
                     "--microbatch-size", "2", "--json"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1] and outputs[0]["busy"][3] > outputs[0]["busy"][1]


def test_plan_hf_prints_a_train_command_with_hf(llama_json, capsys):
    argv = ["plan", "--hf", str(llama_json), "--gpus", "8", "--gpu-memory", "80", "--global-batch", "16",
            "--schedules", "1f1b", "--microbatch-sizes", "1", "--seq-chunks", "1", "--tp", "1", "--top", "1",
            "--jobs", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "32 heads (8 KV), SwiGLU 14336, vocabulary 128256, 8.03B parameters" in out and "seq 4096" in out
    train = next(line.strip() for line in out.splitlines() if line.strip().startswith("pipeblocks train"))
    launch = next(line.strip() for line in out.splitlines() if line.strip().startswith("torchrun"))
    assert f"--hf {llama_json.parent} --seq 4096 --microbatch-size 1" in train and "--schedule 1f1b" in train
    assert launch.endswith(train.partition("train")[2])
    for size in ("--layers", "--hidden", "--heads", "--model-family"):
        assert size not in train
    parsed = build_parser().parse_args(shlex.split(train)[1:])  # every option it writes is one train takes
    assert (parsed.hf, parsed.seq, parsed.microbatch_size, parsed.name) == (str(llama_json.parent), 4096, 1, "1f1b")
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["hf"] == str(llama_json.parent) and data["model"]["params"] == 8_030_261_248
    assert data["model"]["shape"]["kv_heads"] == 8 and not data["model"]["dropout"]


def test_a_llama_preset_plan_names_the_llama_family(capsys):
    assert main(["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu-memory", "80", "--global-batch", "16",
                 "--seq", "2048", "--schedules", "1f1b", "--microbatch-sizes", "1", "--seq-chunks", "1", "--tp", "2",
                 "--top", "1", "--jobs", "1"]) == 0
    train = next(line for line in capsys.readouterr().out.splitlines() if "pipeblocks train" in line)
    assert "--layers 32 --hidden 4096 --heads 32 --seq 2048" in train
    assert train.endswith("--model-family llama --kv-heads 8") and "--hf" not in train
    parsed = build_parser().parse_args(shlex.split(train.strip())[1:])
    assert (parsed.model_family, parsed.kv_heads, parsed.tp) == ("llama", 8, 2)


def test_bad_hf_input_is_one_line(llama_json, tmp_path, capsys):
    for command in (["simulate", "1f1b"], ["plan", "--gpus", "8", "--gpu-memory", "80", "--global-batch", "16"]):
        assert main([*command, "--hf", str(llama_json), "--model", "llama-3-8b"]) == 2
        assert "not allowed with argument" in capsys.readouterr().err
    missing = tmp_path / "nowhere"
    assert main(["simulate", "1f1b", "--hf", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "does not exist: give a Hugging Face model directory" in err and len(err.strip().splitlines()) == 1
    assert main(["plan", "--gpus", "8", "--gpu-memory", "80", "--global-batch", "16"]) == 2
    assert "one of the arguments --model --hf is required" in capsys.readouterr().err
    other = tmp_path / "gpt2.json"
    other.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 12}))
    assert main(["plan", "--hf", str(other), "--gpus", "8", "--gpu-memory", "80", "--global-batch", "16"]) == 2
    assert "names architecture 'GPT2LMHeadModel': pipeblocks trains LlamaForCausalLM" in capsys.readouterr().err
    with pytest.raises(ValueError, match="give either --model .* or --hf"):
        CostSpec(model="llama-3-8b", hf=str(llama_json))
    with pytest.raises(ValueError, match="--seq and --microbatch-size size the analytic model"):
        CostSpec(seq=1024)
