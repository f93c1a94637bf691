"""Per-stage costs of one pipeline replica on a dp x tp x pp mesh.

The pipeline side's times are the simulator's analytic model (`sim.analytic.transformer_costs`);
its activation side is the memory estimate's (`sim.memory_estimate.activation_costs`: M_B
per stage, what a split backward keeps for W, what a recomputed forward keeps), so at
tp = 1 the activation the planner ranks by is `estimate_memory`'s.

Tensor parallelism is folded in as the runtime runs it (`runtime.tensor_parallel`,
Megatron-style with sequence parallelism): pass FLOPs and parameters are divided by tp and
every layer adds its collectives to the forward and the input-gradient pass, two
all-gather + reduce-scatter pairs of its activation (s*b*h elements) on the intra-node
link (`core.cost.tp_model.TPCostModel`, tp never leaves a node); W carries none. A recomputed
forward (1f1b-r) pays them again, since the simulator's recomputation takes the stage's
forward time. Stored activations are what one tp rank saves (`activation_costs(tp=)`:
the gathered GEMM inputs and the loss stay whole), as `estimate_memory(tp=)` has them.

Ranks are ordered (pp, dp, tp), tp fastest: a DP ring has stride tp and spans dp*tp
consecutive ranks, so it stays inside a node when dp*tp <= gpus_per_node. A pipeline hop
runs on the profile's pipeline link, as in `simulate`; with sequence parallelism it
carries 1/tp of the activation per rank.

With `intensity`, pass times also carry the kernel-efficiency model of `plan.intensity`
(smaller GEMMs reach less of the peak); without it they are the simulator's.
"""
from __future__ import annotations

import dataclasses

from ..core.cost.costs import Costs
from ..core.cost.dp_model import DPCostModel
from ..core.ir.sharding import ShardingPolicy
from ..sim.blocks import transformer_blocks
from ..sim.analytic import Hardware, TransformerConfig, dp_link, stage0_backward_in_w, transformer_costs
from ..sim.memory_estimate import activation_costs, precision_config
from ..sim.tp_costs import tp_model
from .intensity import head_efficiency, layer_efficiency

__all__ = ["replica_costs"]


def replica_costs(
    config: TransformerConfig, hardware: Hardware, *, num_stages: int, dp: int, tp: int,
    sharding: ShardingPolicy = ShardingPolicy.REPLICATE, precision: str = "bf16-mixed", intensity: bool = False,
    seq_chunks: int = 1, w_keeps: str = "graph", dp_unit: str = "block",
) -> Costs:
    """The costs of one pipeline replica of `num_stages` global stages whose ranks each
    hold 1/tp of their stages; the data-parallel side has `dp` replicas under `sharding`.
    `intensity`: slow each pass by its GEMMs' efficiency (`plan.intensity`), whose rows are
    the tokens of one of `seq_chunks` sequence chunks (a chunked microbatch runs smaller GEMMs).
    `w_keeps`: what a split backward keeps from B until W (`sim.memory_estimate.estimate_memory`).
    `precision` prices the DP side and sets the activations' dtype (`sim.memory_estimate.precision_config`).
    `dp_unit`: the grain of the DP collectives (`core.ir.dp_units`): "block" (one gather and one
    reduction per layer, as FSDP2 per block and DDP's buckets) or "chunk" (one per chunk)."""
    config, _ = precision_config(config, precision)
    memory = activation_costs(config, num_stages, w_keeps=w_keeps, tp=tp)
    base = dataclasses.replace(
        transformer_costs(config, hardware, num_stages=num_stages, stage0_input_grad=True), mem_b=memory.mem_b,
        mem_w_ratio=memory.mem_w_ratio, recompute_input_ratio=memory.recompute_input_ratio,
    )
    if intensity:
        base = _with_intensity(base, config, hardware, tp, seq_chunks)
    if seq_chunks == 1:  # stage 0's B has nothing to do (with sequence chunks: earlier K/V gradients)
        base = stage0_backward_in_w(base)
    data_parallel = DPCostModel(dp=dp, sharding=(sharding,), link=dp_link(hardware, dp * tp), precision=precision,
                                unit=dp_unit)
    base = dataclasses.replace(base, blocks=transformer_blocks(config, num_stages=num_stages))
    if tp == 1:
        return dataclasses.replace(base, data_parallel=data_parallel)
    activation = config.hidden_bytes
    split = tp_model(hardware, tp).split(base, layers=config.stage_layers(num_stages),
                                         activation_bytes=activation)
    hop = hardware.latency + activation / tp / hardware.bandwidth  # each rank sends its token shard
    if seq_chunks == 1:  # stage 0's tensor-parallel collectives of the backward run in its W too
        split = stage0_backward_in_w(split)
    return dataclasses.replace(split, params=tuple(x / tp for x in base.params), t_comm=hop,
                               data_parallel=data_parallel)


def _with_intensity(costs: Costs, config: TransformerConfig, hardware: Hardware, tp: int, chunks: int) -> Costs:
    """Each stage's layer time over the layer efficiency and the head's over the head's.
    The head is the last stage's 2*s*b*h*V FLOPs in each pass (`transformer_costs`)."""
    chunk = dataclasses.replace(config, seq=max(1, config.seq // chunks))
    layer, head = layer_efficiency(chunk, hardware, tp), head_efficiency(chunk, hardware, tp)
    rate = hardware.flops * hardware.efficiency
    head_time = 2 * config.seq * config.microbatch_size * config.hidden * config.vocab / rate
    last = len(costs.t_f) - 1

    def scaled(times: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(
            (t - head_time) / layer + head_time / head if i == last else t / layer for i, t in enumerate(times)
        )

    return dataclasses.replace(costs, t_f=scaled(costs.t_f), t_b=scaled(costs.t_b), t_w=scaled(costs.t_w))
