"""The analytic per-rank memory (`sim.memory_estimate`) against the runtime's measured
memory of the reference GPT: static plus peak activation within 5% for every process of
every configuration, and the per-stage activation terms against the runtime's profile."""
from __future__ import annotations

import dataclasses

import pytest

from pipeblocks import schedules
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.sim.analytic import TransformerConfig, stage_activation_bytes
from pipeblocks.sim.memory_estimate import estimate_memory, stage_param_shapes

from _memory_fidelity_cases import ANALYTIC, CASES, WORLD, build_schedule, fidelity_worker

TOLERANCE = 0.05


@pytest.mark.spawn
def test_estimate_within_five_percent_of_measured_per_process():
    from pipeblocks.runtime import spawn

    per_process = spawn(fidelity_worker, WORLD, args=(list(CASES),), timeout_s=300, threads_per_rank=1)
    for case, (_, _, _, _, dp, sharding) in CASES.items():
        estimate = estimate_memory(ANALYTIC, build_schedule(case), dp=dp, sharding=(sharding,))
        assert len(estimate.ranks) == WORLD
        for result in per_process:
            got = result[case]
            want = estimate.rank(got["rank"], got["dp_rank"])
            measured = got["static"] + got["activation"]
            where = f"{case}, rank {got['rank']} replica {got['dp_rank']}"
            # the comparison means something only where activations are a real part of the total
            assert got["activation"] > 0.25 * measured, f"{where}: activations {got['activation']} of {measured} B"
            assert want.total == pytest.approx(measured, rel=TOLERANCE), (
                f"{where}: estimated {want.total:.0f} B (static {want.static_bytes:.0f}, activation "
                f"{want.activation_bytes:.0f}), measured {measured} B (static {got['static']}, "
                f"activation {got['activation']})")
            assert want.activation_bytes == pytest.approx(got["activation"], rel=TOLERANCE), where
            assert want.static_bytes == pytest.approx(got["static"], rel=TOLERANCE), where


@pytest.mark.torch
@pytest.mark.parametrize("layers, hidden, heads, seq, vocab, b, stages, dtype", [
    (4, 64, 4, 64, 256, 2, 2, "float32"),
    (7, 96, 6, 48, 100, 3, 4, "float32"),   # uneven split: the end stages get the lighter share
    (2, 64, 8, 32, 256, 2, 2, "float64"),
])
def test_stage_activation_terms_match_the_runtime_profile(layers, hidden, heads, seq, vocab, b, stages, dtype):
    """M_B per stage, term by term, is what the runtime's own forward saves (embedding ids on
    the first stage, final LayerNorm and loss on the last), and B frees exactly the loss."""
    import torch

    from pipeblocks.models import GPT, GPTConfig, cross_entropy, split_stages
    from pipeblocks.runtime.profile import profile_stage_memory
    from pipeblocks.sim.analytic import loss_activation_bytes

    model = GPTConfig(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, dtype=dtype)
    modules = split_stages(model, GPT(model, seed=0), stages)
    x, y = torch.randint(0, vocab, (b, seq)), torch.randint(0, vocab, (b, seq))
    profile = profile_stage_memory(modules, x, cross_entropy, y)
    config = TransformerConfig(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, microbatch_size=b,
                               dtype=dtype, flash_attention=True, dropout=False)
    assert stage_activation_bytes(config, stages) == tuple(float(s.m_b) for s in profile)
    assert profile[-1].m_b - profile[-1].m_w == loss_activation_bytes(config)
    shapes = stage_param_shapes(config, stages)
    assert [[tuple(q.shape) for q in m.parameters()] for m in modules] == [list(s) for s in shapes]


def test_estimate_shards_static_memory_and_keeps_activations():
    schedule = schedules.get("1f1b")(p=2, m=4)
    plain = estimate_memory(ANALYTIC, schedule)
    zero3 = estimate_memory(ANALYTIC, schedule, dp=2, sharding=("zero3",))
    assert [r.activation_bytes for r in plain.ranks] == [r.activation_bytes for r in zero3.ranks if r.dp_rank == 0]
    # at the step's peak zero3 holds full parameters and gradients, a parameter shard and
    # the state shard: 4 + 2 + 4 + 8/2 of fp32 AdamW's 16 bytes per parameter = 14/16
    for r in range(2):
        assert zero3.rank(r).static_bytes == pytest.approx(plain.rank(r).static_bytes * 14 / 16, rel=1e-3)
    assert plain.peak == max(r.total for r in plain.ranks)
    # bf16-mixed ("mixed"): float32 master 4 + bfloat16 compute copy 2 + float32 gradient 4
    # + AdamW state 8 bytes per parameter, and bfloat16 activations: the same estimate as a
    # bf16 model's under "auto"
    mixed = estimate_memory(ANALYTIC, schedule, precision="mixed")
    assert mixed.rank(0).static_bytes == pytest.approx(plain.stage_params[0] * 18)
    bf16 = estimate_memory(dataclasses.replace(ANALYTIC, dtype="bf16"), schedule)
    assert [(r.static_bytes, r.activation_bytes) for r in bf16.ranks] == [
        (r.static_bytes, r.activation_bytes) for r in mixed.ranks]
    assert all(m.activation_bytes < 0.6 * r.activation_bytes for m, r in zip(mixed.ranks, plain.ranks))
    # mixed zero2 at the peak: the float32 shard, bf16 gathered parameters, full float32
    # gradients, half the state
    mixed2 = estimate_memory(ANALYTIC, schedule, dp=2, sharding=("zero2",), precision="mixed")
    assert mixed2.rank(1, dp_rank=1).static_bytes == pytest.approx(plain.stage_params[1] * (2 + 2 + 4 + 4))
    with pytest.raises(ValueError, match=r"no process \(rank 2, replica 0\): ranks are 0..1, replicas 0..1"):
        mixed2.rank(2)


def test_estimate_recompute_and_what_w_keeps():
    plain = estimate_memory(ANALYTIC, schedules.get("1f1b")(p=2, m=4))
    recomputed = estimate_memory(ANALYTIC, schedules.get("1f1b-r")(p=2, m=4))
    # rank 0 keeps the token ids of 1 + 2 waiting microbatches, then one stage's whole
    # activation while its forward is rebuilt
    tokens = ANALYTIC.seq * ANALYTIC.microbatch_size
    assert recomputed.rank(0).activation_bytes <= plain.stage_activation[0] + 2 * 8 * tokens
    assert recomputed.rank(0).activation_bytes >= plain.stage_activation[0]
    assert recomputed.rank(0).static_bytes == plain.rank(0).static_bytes
    # with stored attention probabilities W needs a smaller share of what F saved, so a
    # middle rank of ZB-H1 (whose W passes wait) holds less when B frees the rest
    megatron = dataclasses.replace(ANALYTIC, flash_attention=False, dropout=True)
    zb = schedules.get("zb-h1")(p=4, m=8)
    graph, weights = estimate_memory(megatron, zb), estimate_memory(megatron, zb, w_keeps="weights")
    assert weights.rank(1).activation_bytes < 0.95 * graph.rank(1).activation_bytes
    assert weights.rank(1).activation_bytes > 0.5 * graph.rank(1).activation_bytes


def test_estimate_rejects_bad_input():
    schedule = schedules.get("1f1b")(p=2, m=4)
    with pytest.raises(ValueError, match="dp must be an integer >= 1"):
        estimate_memory(ANALYTIC, schedule, dp=0)
    with pytest.raises(ValueError, match="precision 'bf32'"):
        estimate_memory(ANALYTIC, schedule, precision="bf32")
    with pytest.raises(ValueError, match="w_keeps 'all'"):
        estimate_memory(ANALYTIC, schedule, w_keeps="all")
    with pytest.raises(TypeError, match="built Schedule"):
        estimate_memory(ANALYTIC, "1f1b")
    with pytest.raises(ValueError, match="--sharding"):
        estimate_memory(ANALYTIC, schedule, sharding=("zero9",))
    with pytest.raises((ValueError, ScheduleError), match="gives 3 policies but the schedule has 2 chunks"):
        estimate_memory(ANALYTIC, schedule, sharding=("zero1", "zero3", "zero1"))
