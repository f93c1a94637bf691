"""The analytic costs of whole stages as one of tp tensor-parallel ranks runs them
(`simulate --tp T --model ...`), and the time each rank spends in tensor-parallel collectives.

    >>> costs = tensor_parallel_costs(transformer_costs(config, hw, num_stages=4), config, hw, num_stages=4, tp=2)
    >>> tp_comm_per_rank(schedule, config, hw, tp=2)     # seconds per pipeline rank and step

The collectives are `core.cost.tp_model.TPCostModel`'s (the planner's too): two all-gather +
reduce-scatter pairs per layer in F and in B, on the hardware's intra-node link; W has
none. They move the hidden state (s*b*h values), whatever the block's inner widths (the
heads, KV heads and MLP features each rank computes stay on it). F, B and W compute and
the parameters are divided by tp, which must divide the heads, the KV heads, the MLP width
and the vocabulary (`tp_memory.tp_mismatch`); a rank's saved activations are `tp_memory`'s;
a pipeline hop carries 1/tp of the activation (sequence parallelism). The DP side (`--dp`)
then sees a rank's 1/tp of the parameters (the norms, whole on every rank, are counted
1/tp too: a few h per layer).
"""
from __future__ import annotations

import dataclasses

from ..core.cost.costs import Costs
from ..core.cost.dp_model import Link
from ..core.ir.schedule import Schedule
from ..core.cost.tp_model import TPCostModel
from .analytic import Hardware, TransformerConfig
from .tp_memory import tp_stage_activation_bytes

__all__ = ["tensor_parallel_costs", "tp_comm_per_rank", "tp_model"]


def tp_model(hardware: Hardware, tp: int) -> TPCostModel:
    """Tensor parallelism of `tp` ranks on the hardware's intra-node link."""
    return TPCostModel(tp=tp, link=Link(hardware.intra_bandwidth, hardware.intra_latency))


def tensor_parallel_costs(costs: Costs, config: TransformerConfig, hardware: Hardware, *, num_stages: int,
                          tp: int) -> Costs:
    """`costs` of whole stages (`analytic.transformer_costs`) as one of `tp` ranks runs them."""
    if tp == 1:
        return costs
    activation = config.hidden_bytes
    split = tp_model(hardware, tp).split(costs, layers=config.stage_layers(num_stages),
                                         activation_bytes=activation)
    blocks = costs.blocks
    if blocks is not None:
        blocks = dataclasses.replace(blocks, params=tuple(tuple(x / tp for x in row) for row in blocks.params))
    return dataclasses.replace(
        split, mem_b=tp_stage_activation_bytes(config, num_stages, tp), blocks=blocks,
        params=tuple(x / tp for x in costs.params) if isinstance(costs.params, tuple) else costs.params / tp,
        t_comm=hardware.latency + activation / tp / hardware.bandwidth,
    )


def tp_comm_per_rank(schedule: Schedule, config: TransformerConfig, hardware: Hardware, *, tp: int,
                     recompute=frozenset()) -> list[float]:
    """Seconds each pipeline rank spends in tensor-parallel collectives in one step: its
    stages' F and B of every microbatch, and each recomputed forward again."""
    per_stage = tp_model(hardware, tp).stage_comm(config.stage_layers(schedule.num_stages),
                                                  config.hidden_bytes)
    placement = schedule.placement
    out = []
    for r in range(schedule.p):
        mine = placement.stages_of(r)
        again = sum(per_stage[s] for s, _ in recompute if s in mine)
        out.append(schedule.m * sum(2 * per_stage[s] for s in mine) + again)
    return out
