"""Per-stage costs of one pipeline replica on a dp x tp x pp mesh.

The pipeline side is the simulator's analytic model (`sim.analytic.transformer_costs`),
unchanged, so at tp = 1 these are exactly the costs `pipeblocks simulate --model ...`
uses and the memory the planner ranks by is the number `simulate` reports.

Tensor parallelism is folded in analytically, Megatron-style with sequence parallelism
(Shoeybi et al. 2019; Korthikanti et al. 2022): each stage's parameters, pass FLOPs and
stored activations are divided by tp, and every layer adds two all-reduces of its
activation (s*b*h elements) to the forward and two to the input-gradient pass, on the
intra-node link (tp never leaves a node). W carries no tensor-parallel communication.
A recomputed forward (1f1b-r) pays its all-reduces again, since the simulator's
recomputation takes the stage's forward time.

Ranks are ordered (pp, dp, tp), tp fastest: a DP ring has stride tp and spans dp*tp
consecutive ranks, so it stays inside a node when dp*tp <= gpus_per_node. A pipeline hop
runs on the profile's pipeline link, as in `simulate`; with sequence parallelism it
carries 1/tp of the activation per rank.
"""
from __future__ import annotations

import dataclasses

from ..core.costs import Costs
from ..core.dp_model import DataParallel, Link, all_reduce_time
from ..core.sharding import ShardingPolicy
from ..sim.analytic import Hardware, TransformerConfig, dp_link, layer_split, transformer_costs

__all__ = ["tp_all_reduce_time", "replica_costs"]


def tp_all_reduce_time(config: TransformerConfig, hardware: Hardware, tp: int) -> float:
    """One tensor-parallel all-reduce of a layer's activation (ring, intra-node link)."""
    size = config.seq * config.microbatch_size * config.hidden * config.dtype_bytes
    return all_reduce_time(size, tp, Link(hardware.intra_bandwidth, hardware.intra_latency))


def replica_costs(
    config: TransformerConfig, hardware: Hardware, *, num_stages: int, dp: int, tp: int,
    sharding: ShardingPolicy = ShardingPolicy.REPLICATE, precision: str = "mixed",
) -> Costs:
    """The costs of one pipeline replica of `num_stages` global stages whose ranks each
    hold 1/tp of their stages; the data-parallel side has `dp` replicas under `sharding`."""
    base = transformer_costs(config, hardware, num_stages=num_stages)
    data_parallel = DataParallel(dp=dp, sharding=(sharding,), link=dp_link(hardware, dp * tp), precision=precision)
    if tp == 1:
        return dataclasses.replace(base, data_parallel=data_parallel)
    counts = layer_split(config.layers, num_stages)
    per_pass = 2 * tp_all_reduce_time(config, hardware, tp)  # two all-reduces per layer and pass
    activation = config.seq * config.microbatch_size * config.hidden * config.dtype_bytes
    hop = hardware.latency + activation / tp / hardware.bandwidth
    return dataclasses.replace(
        base,
        t_f=tuple(t / tp + n * per_pass for t, n in zip(base.t_f, counts)),
        t_b=tuple(t / tp + n * per_pass for t, n in zip(base.t_b, counts)),
        t_w=tuple(t / tp for t in base.t_w),
        mem_b=tuple(x / tp for x in base.mem_b),
        params=tuple(x / tp for x in base.params),
        t_comm=hop,
        data_parallel=data_parallel,
    )
