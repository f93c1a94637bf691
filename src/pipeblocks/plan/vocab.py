"""The planner's price of vocabulary parallelism (`plan --vocab-parallel`, docs/vocab-parallel.md).

A candidate with vocabulary parallelism is one pipeline replica of `replica_costs` with the head
and loss taken off its last stage and the token table off its first, and the four vocabulary
passes on every one of its pp ranks (`sim.vocab_costs`). The planner's intensity model slows
the head's product by its shape (`plan.intensity.head_efficiency`); a rank's shard multiplies an
s*b x h by h x ceil(V/p) product, narrower than the whole head, so it runs at its own, lower
efficiency. Tensor parallelism and sequence chunks are not combined with it (the runtime splits
the vocabulary over the pipeline ranks only, and runs whole microbatches).

    >>> from pipeblocks.sim.analytic import MODELS, HARDWARE
    >>> costs = vocab_replica_costs(MODELS["llama-3-8b"], HARDWARE["a100"], num_stages=8, ranks=8, dp=1)
    >>> costs.vocab.params == 16032 * 4096 * 2
    True
"""
from __future__ import annotations

import dataclasses

from ..core.cost.costs import Costs
from ..core.ir.sharding import ShardingPolicy
from ..sim.analytic import Hardware, TransformerConfig, head_flops
from ..sim.memory_estimate import precision_config
from ..sim.vocab_costs import head_seconds, shard_rows, with_vocab_parallel
from .costs import replica_costs
from .intensity import head_efficiency, layer_efficiency

__all__ = ["vocab_replica_costs"]


def vocab_replica_costs(
    config: TransformerConfig, hardware: Hardware, *, num_stages: int, ranks: int, dp: int,
    sharding: ShardingPolicy = ShardingPolicy.REPLICATE, precision: str = "bf16-mixed", intensity: bool = False,
    w_keeps: str = "graph", dp_unit: str = "block",
) -> Costs:
    """`replica_costs` at tp = 1 of `num_stages` stages on `ranks` pipeline ranks, with the
    vocabulary layers split over the ranks (the module docstring)."""
    costs = replica_costs(config, hardware, num_stages=num_stages, dp=dp, tp=1, sharding=sharding,
                          precision=precision, intensity=intensity, w_keeps=w_keeps, dp_unit=dp_unit)
    config, _ = precision_config(config, precision)
    head = head_seconds(config, hardware)
    efficiency = 1.0
    if intensity:
        # what `replica_costs` made of the head's part of the last stage: its product over the
        # head's efficiency, the rest (the loss's bytes) over the layer's, as plan.costs scales it
        head_time = head_flops(config) / (hardware.flops * hardware.efficiency)
        layer, whole = layer_efficiency(config, hardware, 1), head_efficiency(config, hardware, 1)
        head = tuple((h - head_time) / layer + head_time / whole for h in head)
        shard = dataclasses.replace(config, vocab=shard_rows(config.vocab, ranks))
        efficiency = head_efficiency(shard, hardware, 1)
    return with_vocab_parallel(costs, config, hardware, ranks=ranks, head=head, gemm_efficiency=efficiency)
