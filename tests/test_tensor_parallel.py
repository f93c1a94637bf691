"""Tensor parallelism before launch: the sizes --tp must divide, the options it refuses,
the (pp, dp, tp) world, and the plans of the model families (no processes started)."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from pipeblocks.cli.main import main
from pipeblocks.core.lowering.async_mode import AsyncMode
from pipeblocks.resolve.request import Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import parse_sharding
from pipeblocks.models.config import GPTConfig
from pipeblocks.models import build_model, split_stages
from pipeblocks.models.family import get_family
from pipeblocks.models.llama_config import LlamaConfig
from pipeblocks.models.tp_plan import check_tp
from pipeblocks.runtime.mesh import check_world_size
from pipeblocks.train.run import prepare

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
FAMILIES = ("gpt", "llama") + (("hf-llama",) if HAS_TRANSFORMERS else ())

pytestmark = pytest.mark.torch


def _prepare(tp: int = 2, *, name: str = "1f1b", dp: int = 1, sharding: str = "replicate", model=None, **options):
    request = ScheduleRequest(name=name, m=4, mesh=Mesh(pp=2, dp=dp, tp=tp), sharding=parse_sharding(sharding))
    model = model or LlamaConfig(layers=4, hidden=16, heads=2, kv_heads=2, seq=8)
    return prepare(request, model=model, microbatch_size=1, **options)


def test_tp_must_divide_heads_kv_heads_mlp_vocab_and_seq():
    from pipeblocks.models.shapes import gpt_shape, llama_shape

    check_tp(llama_shape(LlamaConfig(heads=4, kv_heads=2, hidden=64, seq=64, vocab=256)), 2, seq=64)
    check_tp(gpt_shape(GPTConfig(heads=4, hidden=64, seq=64, vocab=256)), 4, seq=64)
    with pytest.raises(ValueError, match=r"--tp 3 does not divide the model's 4 heads: .*--tp 1 or 2 or 4"):
        check_tp(llama_shape(LlamaConfig(heads=4, hidden=64)), 3, seq=64)
    with pytest.raises(ValueError, match=r"--tp 2 does not divide the model's 1 KV heads"):
        check_tp(llama_shape(LlamaConfig(heads=4, kv_heads=1, hidden=64)), 2, seq=64)
    with pytest.raises(ValueError, match=r"--tp 4 does not divide the model's 66 tokens per sequence"):
        check_tp(gpt_shape(GPTConfig(heads=4, hidden=64, seq=66)), 4, seq=66)
    with pytest.raises(ValueError, match=r"--tp 2 does not divide the model's 255 vocabulary"):
        check_tp(gpt_shape(GPTConfig(heads=4, hidden=64, vocab=255)), 2, seq=64)
    with pytest.raises(ValueError, match=r"--tp 2 does not divide the model's 1 heads"):
        _prepare(model=LlamaConfig(layers=4, hidden=16, heads=1, seq=8))


@pytest.mark.parametrize("options, said", [
    ({"async_mode": AsyncMode("pipedream")}, "--tp 2 with --async is not supported"),
    ({"clip_grad": 1.0}, "--clip-grad is not supported with --tp 2"),
])
def test_tp_refuses_what_it_does_not_run(options, said):
    with pytest.raises(ValueError, match=said):
        _prepare(**options)


def test_tp_refuses_sequence_chunks_and_non_fsdp_data_parallelism():
    with pytest.raises(ValueError, match="--tp 2 with --seq-chunks 2 is not supported"):
        _prepare(name="seq1f1b")
    with pytest.raises(ValueError, match="--tp 2 with --dp 2 and sharding replicate: .* use --sharding zero2 or zero3"):
        _prepare(dp=2)
    cfg, _ = _prepare(dp=2, sharding="zero3", verify=True)
    assert cfg.world_size == 8 and cfg.tp == 2 and cfg.meta("x")["tp"] == 2


def test_tp1_is_todays_run():
    cfg, _ = _prepare(tp=1)
    assert cfg.tp == 1 and cfg.world_size == 2 and "tp" not in cfg.meta("x") and not cfg.data_parallel


def test_world_sizes_name_all_three_dims(monkeypatch):
    with pytest.raises(ValueError, match=r"needs p x d x t = 2 x 1 x 2 = 4 processes but the world has 2"):
        check_world_size(2, 1, 2, tp=2)
    check_world_size(2, 2, 8, tp=2)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"needs p x dp x tp = 4 processes but torchrun started 2 .*-p, --dp and --tp"):
        _prepare()


def test_cli_tp_option_reaches_the_config(capsys):
    code = main(["train", "--model-family", "llama", "--tp", "2", "--kv-heads", "1", "--heads", "2", "--hidden", "16",
                 "--layers", "4", "--seq", "8", "--dry-run"])
    assert code == 2
    assert "--tp 2 does not divide the model's 1 KV heads" in capsys.readouterr().err


@pytest.mark.parametrize("family", FAMILIES)
def test_every_projection_of_a_block_is_in_the_plan(family):
    """Each block's linear layers are split (column- or row-wise), its norms run sequence-parallel."""
    fam = get_family(family)
    spec = fam.spec(fam.config(layers=2, hidden=16, heads=2, seq=8, vocab=256))
    stage = split_stages(spec, build_model(spec, seed=0), 1)[0]
    plan = spec.tp_plan()
    _, block = stage.block_items()[0]
    linears = {name for name, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears <= set(plan.block), linears - set(plan.block)
    ends = {name for name, m in stage.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
            and not name.startswith(stage.layout.blocks)}
    assert ends <= set(plan.first) | set(plan.last), ends


def test_gpt_fused_qkv_is_grouped_by_head():
    """A row split of the fused projection into t blocks gives each block whole heads: the
    attention over heads [0, a/2) of the whole model equals attention with the first half."""
    from pipeblocks.models.gpt import CausalSelfAttention

    cfg = GPTConfig(hidden=16, heads=4, dtype="float64")
    attn = CausalSelfAttention(cfg)
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    half = CausalSelfAttention(cfg)
    with torch.no_grad():
        half.qkv.weight = torch.nn.Parameter(attn.qkv.weight[:24].clone())
        half.qkv.bias = torch.nn.Parameter(attn.qkv.bias[:24].clone())
        half.proj.weight = torch.nn.Parameter(attn.proj.weight[:, :8].clone())
        half.proj.bias = torch.nn.Parameter(torch.zeros(16, dtype=torch.float64))
        other = CausalSelfAttention(cfg)
        other.qkv.weight = torch.nn.Parameter(attn.qkv.weight[24:].clone())
        other.qkv.bias = torch.nn.Parameter(attn.qkv.bias[24:].clone())
        other.proj.weight = torch.nn.Parameter(attn.proj.weight[:, 8:].clone())
        other.proj.bias = attn.proj.bias
        torch.testing.assert_close(half(x) + other(x), attn(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_the_memory_model_holds_the_shapes_the_gpt_plan_splits(num_stages):
    """`sim.tp_memory`'s per-rank GPT shapes are what the runtime's plan leaves on a tp rank."""
    from pipeblocks.runtime.tensor_parallel import planned_shapes
    from pipeblocks.sim.analytic import TransformerConfig
    from pipeblocks.sim.memory_estimate import stage_param_shapes

    spec = get_family("gpt").spec(GPTConfig(layers=4, hidden=16, heads=2, seq=8, vocab=256))
    analytic = TransformerConfig(layers=4, hidden=16, heads=2, seq=8, vocab=256)
    stages = split_stages(spec, build_model(spec, seed=0), num_stages)
    for tp in (1, 2):
        expected = stage_param_shapes(analytic, num_stages, tp)
        assert [tuple(planned_shapes(st, spec.tp_plan(), tp)) for st in stages] == list(expected)


def test_estimate_memory_at_tp1_is_unchanged_and_tp_splits_it():
    from pipeblocks.schedules import get
    from pipeblocks.sim.analytic import TransformerConfig
    from pipeblocks.sim.memory_estimate import estimate_memory, rank_static_peak

    config = TransformerConfig(layers=4, hidden=64, heads=4, seq=64, vocab=256, microbatch_size=2, dtype="fp32",
                               flash_attention=True, dropout=False)
    schedule = get("1f1b")(p=2, m=4)
    whole, split = estimate_memory(config, schedule), estimate_memory(config, schedule, tp=2)
    assert whole == estimate_memory(config, schedule, tp=1)
    # per layer and token 2h + 14h/t of 16h elements: more than half stays (the gathered GEMM inputs, the loss)
    for a, b in zip(whole.ranks, split.ranks):
        assert 0.5 < b.activation_bytes / a.activation_bytes < 0.65
        assert 0.5 < b.static_bytes / a.static_bytes < 0.51  # norms and row-parallel biases stay whole
        assert rank_static_peak(config, 2, (a.rank,), ("replicate",), dp=1, precision="fp32", tp=2) == b.static_bytes


def test_simulate_prices_tp_with_the_model(capsys):
    """`simulate --tp 2 --model`: compute over 2, each layer's two all-gather + reduce-scatter
    pairs in F and B on the intra-node link (the planner's TPCostModel), per rank tp_comm."""
    import json

    from pipeblocks.sim.analytic import HARDWARE, parse_model
    from pipeblocks.sim.tp_costs import tp_model

    args = ["simulate", "1f1b", "-p", "2", "-m", "4", "--model", "1.5b", "--json"]
    assert main(args) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*args, "--tp", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert "tp" not in one and "tp_comm" not in one and two["tp"] == 2  # without --tp: today's summary
    config = parse_model("1.5b")
    layer = tp_model(HARDWARE["a100-80g"], 2).layer_comm(config.seq * config.microbatch_size * config.hidden * 2)
    layers = config.layers // 2
    assert two["tp_comm"] == pytest.approx([4 * 2 * layers * layer] * 2)
    assert two["busy"][1] - two["tp_comm"][1] == pytest.approx(one["busy"][1] / 2)
    assert 0.5 * one["peak_activation"][0] < two["peak_activation"][0] < 0.6 * one["peak_activation"][0]
    assert main(["simulate", "1f1b", "-p", "2", "-m", "4", "--tp", "2"]) == 2
    assert "--tp 2 is priced by the analytic model: add --model" in capsys.readouterr().err


def test_emulated_tp_ranks_sleep_a_share_of_the_layer_and_its_collectives():
    """Under --emulate each tp rank sleeps 1/tp of a layer's F, B, W and, in F and B, the
    layer's collectives on the --hardware's intra-node link (the simulator's TPCostModel)."""
    from pipeblocks.core.cost.dp_model import Link
    from pipeblocks.core.cost.tp_model import TPCostModel
    from pipeblocks.sim.analytic import HARDWARE
    from pipeblocks.train.rank_setup import emulated_costs

    cfg, _ = _prepare(emulate=(8.0, 6.0, 4.0), model=GPTConfig(layers=4, hidden=64, heads=4, seq=64))
    a100 = HARDWARE["a100-80g"]
    assert cfg.emulation.tp_link == (a100.intra_bandwidth, a100.intra_latency)
    comm = TPCostModel(tp=2, link=Link(*cfg.emulation.tp_link)).layer_comm(1 * 64 * 64 * 4) * 1e3
    costs = emulated_costs(cfg)
    assert (costs.f_ms, costs.b_ms, costs.w_ms) == pytest.approx((4.0 + comm, 3.0 + comm, 2.0))
    assert emulated_costs(_prepare(tp=1, emulate=(8.0, 6.0, 4.0))[0]).f_ms == 8.0


def test_a_tp_group_that_would_span_nodes_is_warned_about_on_cuda(monkeypatch, capsys):
    from pipeblocks.train.prepare_checks import warn_tp_across_nodes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    warn_tp_across_nodes(8, "cuda")
    assert "--tp 8 does not divide the 4 processes per node" in capsys.readouterr().err
    for tp, device in ((2, "cuda"), (8, "cpu")):
        warn_tp_across_nodes(tp, device)
        assert capsys.readouterr().err == ""


def test_a_gpt_checkpoint_from_before_the_qkv_grouping_is_refused():
    # the reference GPT's fused qkv is grouped by head (the tensor-parallel split); a checkpoint
    # written before holds the old layout under the same shapes, and has no qkv_layout to agree on
    from pipeblocks.train import checkpoint as ckpt

    cfg, _ = _prepare(tp=1, model=GPTConfig(layers=4, hidden=16, heads=2, seq=8))
    now = cfg.meta("x")
    assert now["qkv_layout"] == "by-head"
    before = {k: v for k, v in now.items() if k != "qkv_layout"}
    with pytest.raises(ValueError, match=r"qkv_layout: checkpoint None, now 'by-head'.*new --checkpoint directory"):
        ckpt.check_meta(before, now, "ckpt")
    assert "qkv_layout" not in _prepare(tp=1)[0].meta("x")  # Llama has no fused qkv
