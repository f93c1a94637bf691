"""Static memory by precision: the op walk (`core.cost.static_memory.predict_static_peak`) prices
the bytes the runtime holds under bf16-mixed (float32 master 4, bfloat16 compute copy or
gathered parameters 2, float32 gradient 4, AdamW state 8 per parameter), `estimate_memory`
and the planner take their static memory from it for every precision, and the fp32 and
fp64 figures are the ones they were."""
from __future__ import annotations

import dataclasses
import math

import pytest

from pipeblocks import schedules
from pipeblocks.core.cost.dp_model import PRECISIONS, Precision, precision_bytes, static_peak_bytes
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.cost.precision import PRECISION_NAMES, precision_policy
from pipeblocks.core.ir.sharding import ShardingPolicy
from pipeblocks.core.cost.static_memory import chunk_bytes, predict_static_peak
from pipeblocks.sim.analytic import TransformerConfig
from pipeblocks.sim.memory_estimate import estimate_memory, rank_static_peak, stage_param_shapes

MIXED = precision_policy("bf16-mixed")
CONFIG = TransformerConfig(layers=8, hidden=64, heads=4, seq=64, vocab=250, microbatch_size=2, dtype="fp32",
                           flash_attention=True, dropout=False)


def _peak(shapes, policy: str, d: int, dp_rank: int = 0, *, schedule: str = "1f1b", **kw) -> int:
    """Rank 0's predicted peak for a 1F1B pipeline of two ranks whose stage 0 has `shapes`."""
    sched = schedules.get(schedule)(p=2, m=4)
    program = lower_for(sched, policies=(policy,), dp=d)
    mine = sched.placement.stages_of(0)
    return predict_static_peak(program, 0, {s: shapes for s in mine}, (policy,) * sched.num_stages, dp=d,
                               dp_rank=dp_rank, **kw)


def test_the_bytes_per_parameter_come_from_the_precision_policy():
    assert PRECISIONS["bf16-mixed"] == Precision("bf16-mixed", master=4, copy=2, gathered=2, grad=4, optim=8)
    assert PRECISIONS["fp32"] == Precision("fp32", master=4, copy=0, gathered=4, grad=4, optim=8)
    assert PRECISIONS["fp64"] == Precision("fp64", master=8, copy=0, gathered=8, grad=8, optim=16)
    assert precision_bytes("mixed") == precision_bytes(MIXED) == PRECISIONS["bf16-mixed"]
    assert set(PRECISIONS) == set(PRECISION_NAMES)


def test_replicate_on_one_replica_holds_18_bytes_per_parameter_under_bf16_mixed():
    """One replica: no DP op at all, so the peak is sampled at the end of the op walk, with
    the compute copy and the accumulated gradients held (before the optimizer step)."""
    shapes = [(8, 3)] * 4
    n = 96
    assert _peak(shapes, "replicate", 1, precision=MIXED) == n * (4 + 2 + 4 + 8)
    # the first step: no state before the optimizer step, the copy gone after it
    assert _peak(shapes, "replicate", 1, precision=MIXED, optimizer_state=False) == n * (4 + 4 + 8)
    # fp32 has no copy: 16 bytes, as element_size=4 (a same-dtype policy) gives
    assert _peak(shapes, "replicate", 1, precision=precision_policy("fp32")) == n * 16
    assert _peak(shapes, "replicate", 1, element_size=4) == n * 16
    assert _peak(shapes, "replicate", 1, element_size=8) == n * 32
    # on more replicas the peak is before the all-reduce, the copy held there too
    assert _peak(shapes, "replicate", 2, precision=MIXED) == n * 18


def test_a_rank_with_two_chunks_holds_both_copies_at_its_peak():
    shapes = [(8, 3)] * 4
    assert _peak(shapes, "replicate", 1, schedule="zb-v", precision=MIXED) == 2 * 96 * 18
    assert _peak(shapes, "zero1", 2, schedule="zb-v", precision=MIXED) == 2 * 96 * (4 + 2 + 4 + 8 / 2)


@pytest.mark.parametrize("d", [2, 4])
def test_zero1_holds_the_copy_and_its_partition_of_the_state(d):
    even = [(8, 3)] * 4  # four equal tensors: an even partition
    assert _peak(even, "zero1", d, precision=MIXED) == 96 * (4 + 2 + 4 + 8 / d)
    # whole tensors, largest first: replica 0 owns the 10, replica 1 the 6 and the 3
    uneven = [(10,), (6,), (3,)]
    got = [_peak(uneven, "zero1", 2, r, precision=MIXED) for r in (0, 1)]
    assert got == [19 * (4 + 2 + 4) + 10 * 8, 19 * (4 + 2 + 4) + 9 * 8]


@pytest.mark.parametrize("policy", ["zero2", "zero3"])
def test_fsdp_chunks_hold_the_float32_shard_bf16_gathered_parameters_and_float32_gradients(policy):
    """5 rows on 2 replicas: FSDP2 pads to 2 shards of 3 rows; the gathered parameter is the
    padded 6 rows in bfloat16, the gradient accumulates unsharded in float32 until
    REDUCE_GRAD, and the state follows the unpadded local rows (3, then 2)."""
    shapes = [(5, 4)]
    got = [_peak(shapes, policy, 2, r, precision=MIXED) for r in (0, 1)]
    shard, gathered, grads = 3 * 4 * 4, 6 * 4 * 2, 5 * 4 * 4
    assert got == [shard + gathered + grads + 3 * 4 * 8, shard + gathered + grads + 2 * 4 * 8]
    # evenly split, the closed form: m/d + c + g + o/d = 6 + 12/d
    assert _peak([(8, 3)] * 4, policy, 4, precision=MIXED) == 96 * (4 / 4 + 2 + 4 + 8 / 4)
    assert static_peak_bytes(96, ShardingPolicy(policy), 4, PRECISIONS["bf16-mixed"]) == 96 * (1 + 2 + 4 + 2)


def test_chunk_bytes_takes_a_precision_or_an_element_size():
    one = chunk_bytes([(5, 4)], policy=ShardingPolicy.REPLICATE, precision=MIXED)
    assert (one.params, one.copy, one.grads_full, one.optimizer) == (80, 40, 80, 160) and one.peak == 20 * 18
    assert chunk_bytes([(5, 4)], 4) == chunk_bytes([(5, 4)], precision=precision_policy("fp32"))
    with pytest.raises(TypeError, match="not both"):
        chunk_bytes([(5, 4)], 4, precision=MIXED)
    with pytest.raises(TypeError, match="give precision="):
        chunk_bytes([(5, 4)])
    with pytest.raises(ValueError, match="element_size 3"):
        chunk_bytes([(5, 4)], 3)


@pytest.mark.parametrize("precision", ["auto", "fp32", "fp64", "bf16-mixed", "mixed"])
@pytest.mark.parametrize("policy, dp", [("replicate", 1), ("replicate", 2), ("zero1", 3), ("zero2", 3), ("zero3", 2)])
def test_estimate_memory_static_is_the_op_walk_for_every_precision(precision, policy, dp):
    """One path for every precision: `estimate_memory`'s static bytes are the op walk's over
    the lowered Program, and the planner's (`rank_static_peak`, at tp = 1) its worst replica."""
    schedule = schedules.get("zb-v")(p=2, m=4)
    estimate = estimate_memory(CONFIG, schedule, dp=dp, sharding=(policy,), precision=precision)
    program = lower_for(schedule, policies=(policy,), dp=dp)
    shapes = stage_param_shapes(CONFIG, schedule.num_stages)
    name = {"auto": "fp32", "mixed": "bf16-mixed"}.get(precision, precision)
    for r in range(2):
        mine = schedule.placement.stages_of(r)
        walked = [predict_static_peak(program, r, {s: shapes[s] for s in mine}, (policy,) * 4, dp=dp, dp_rank=d,
                                      precision=precision_policy(name)) for d in range(dp)]
        assert [estimate.rank(r, d).static_bytes for d in range(dp)] == walked
        assert rank_static_peak(CONFIG, 4, mine, (policy,), dp=dp, precision=precision,
                                split_backward=schedule.has_split_backward) == max(walked)


def test_bf16_mixed_activations_are_two_bytes_per_element():
    schedule = schedules.get("1f1b")(p=2, m=4)
    mixed = estimate_memory(CONFIG, schedule, precision="bf16-mixed")
    bf16 = estimate_memory(dataclasses.replace(CONFIG, dtype="bf16"), schedule, precision="auto")
    assert mixed.stage_activation == bf16.stage_activation
    assert [r.activation_bytes for r in mixed.ranks] == [r.activation_bytes for r in bf16.ranks]
    assert mixed.stage_activation[1] < 0.6 * estimate_memory(CONFIG, schedule).stage_activation[1]


def test_fp32_and_fp64_figures_are_unchanged():
    """Regression: the figures before bf16-mixed was priced (vocab 250: FSDP2 pads to 3
    replicas, zero1's partition of whole tensors is uneven)."""
    schedule = schedules.get("1f1b")(p=2, m=4)
    plain = estimate_memory(CONFIG, schedule)
    assert [(r.static_bytes, r.activation_bytes) for r in plain.ranks] == [
        (3520512.0, 4230144.0), (3457024.0, 2309124.0)]
    zero1 = estimate_memory(CONFIG, schedule, dp=3, sharding=("zero1",))
    assert [r.static_bytes for r in zero1.ranks] == [2350080.0, 2343936.0, 2347008.0, 2299392.0, 2299392.0,
                                                     2315264.0]
    zero3 = estimate_memory(CONFIG, schedule, dp=3, sharding=("zero3",))
    assert [r.static_bytes for r in zero3.ranks] == [2667456.0, 2667456.0, 2640384.0, 2618848.0, 2618848.0,
                                                     2592768.0]
    fp64 = estimate_memory(CONFIG, schedule, precision="fp64")
    assert [(r.static_bytes, r.activation_bytes) for r in fp64.ranks] == [
        (7041024.0, 8457216.0), (6914048.0, 4617224.0)]
    assert estimate_memory(CONFIG, schedule, precision="float64").ranks == fp64.ranks
    params = sum(math.prod(s) for s in stage_param_shapes(CONFIG, 2)[0])
    assert plain.ranks[0].static_bytes == 16 * params


def test_stage_zero_holds_no_w_gradients_beside_its_gathered_parameters():
    """Under bf16-mixed a W's bfloat16 gradients wait on an FSDP2 chunk's gathered parameters
    for the chunk's next B, except on stage 0, whose input (the tokens) takes no gradient:
    FSDP2 folds its gradients at the end of every backward call (measured exact in the
    runtime: docs/mesh.md)."""
    sched = schedules.get("zb-h1")(p=2, m=4)
    program = lower_for(sched, policies=("zero3",), dp=2)
    shapes = [(64, 16), (16,)]
    piece = chunk_bytes(shapes, policy=ShardingPolicy.ZERO3, d=2, precision=MIXED)
    assert piece.pending > 0
    got = [predict_static_peak(program, r, {r: shapes}, ("zero3",) * 2, dp=2, dp_rank=0, precision=MIXED)
           for r in range(2)]
    assert got == [piece.step_peak(False), piece.step_peak(True)]
    # the simulator's and the planner's closed forms agree: stage 0 without, stage 1 with
    from pipeblocks.core.cost.dp_model import DPCostModel

    model = DPCostModel(dp=2, sharding=(ShardingPolicy.ZERO3,), precision="bf16-mixed")
    alone = [model.static_memory((1000.0, 1000.0), [s], peak=True, split_backward=True) for s in range(2)]
    assert alone[1] - alone[0] == 1000.0 * model.bytes.gathered
