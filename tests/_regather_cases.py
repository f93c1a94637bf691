"""The rank body of the zero3-regather runtime checks (`test_regather_runtime.py`)."""
from __future__ import annotations


def regather_verify_worker(ctx, cfgs: list) -> list:
    """`train --verify`'s rank body for each TrainConfig, with zero3-regather chunks held by
    FSDP2 as zero3 chunks are. The runtime (`runtime.data_parallel._FSDP`) lists the
    FSDP2 policies by name; until it lists zero3-regather (or asks `ShardingPolicy.fsdp`),
    this adds it here, in the worker processes only. Everything else is the runtime's own:
    the Program's UNSHARD/RESHARD ops free and gather the chunk between its visits."""
    from pipeblocks.core.sharding import ShardingPolicy
    from pipeblocks.runtime import data_parallel

    if ShardingPolicy.ZERO3_REGATHER not in data_parallel._FSDP:
        data_parallel._FSDP = (*data_parallel._FSDP, ShardingPolicy.ZERO3_REGATHER)
    from _recompute_cases import verify_worker

    return verify_worker(ctx, cfgs)
