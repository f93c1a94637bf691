"""Static memory under vocabulary parallelism: each rank's stages without the tables, and its rows of them.

The planner prices static memory from tensor shapes (FSDP2 pads each tensor to its shards,
ZeroRedundancyOptimizer partitions whole tensors: `core.cost.static_memory`). With the vocabulary split
(docs/vocab-parallel.md) the token table leaves the first stage and the head (a tied head's copy
too) the last, and every rank holds one [ceil(V/p), h] tensor per table (one when tied), under
the same sharding policy as its stages. `simulate --vocab-parallel` counts the same bytes from
parameter counts (tests/test_plan_vocab.py holds the two equal).

    >>> from pipeblocks.sim.analytic import MODELS
    >>> peak = vocab_rank_static_peak(MODELS["llama-3-8b"], 8, [0], "replicate", dp=1, precision="bf16-mixed", ranks=8)
    >>> round(peak / 1e9, 2)                       # 18 bytes per parameter: 4 layers and 1/8 of both tables
    18.07
"""
from __future__ import annotations

from ..core.cost.dp_model import w_gradients_wait
from ..core.cost.static_memory import chunk_bytes
from .analytic import TransformerConfig
from .memory_estimate import precision_config, stage_param_shapes
from .vocab_costs import shard_rows

__all__ = ["vocab_stage_param_shapes", "vocab_rank_static_peak"]


def vocab_stage_param_shapes(config: TransformerConfig, num_stages: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """`memory_estimate.stage_param_shapes` (tp = 1) without the vocabulary tables: the token
    table leaves the first stage and the head (a tied head's copy too) the last."""
    table = (config.vocab, config.hidden)
    shapes = [list(stage) for stage in stage_param_shapes(config, num_stages)]
    shapes[0].remove(table)
    if table in shapes[-1]:
        shapes[-1].remove(table)
    return tuple(tuple(stage) for stage in shapes)


def vocab_rank_static_peak(config: TransformerConfig, num_stages: int, stages, policy, *, dp: int,
                           precision, ranks: int, split_backward: bool = False) -> float:
    """Static bytes at the step's peak of a pipeline rank holding `stages` under vocabulary
    parallelism, the most over its `dp` replicas: its stages' tensors as
    `memory_estimate.rank_static_peak` counts them (without the tables) and its vocabulary rows,
    one [ceil(V/p), h] tensor per table (one when tied), sharded over dp under `policy` too."""
    _, prec = precision_config(config, precision)
    shapes = vocab_stage_param_shapes(config, num_stages)
    rows = ((shard_rows(config.vocab, ranks), config.hidden),) * (1 if config.tied else 2)
    return float(max(
        sum(chunk_bytes(shapes[s], policy=policy, d=dp, dp_rank=d, precision=prec).step_peak(
            split_backward and w_gradients_wait(s)) for s in stages)
        + chunk_bytes(rows, policy=policy, d=dp, dp_rank=d, precision=prec).peak
        for d in range(dp)
    ))
