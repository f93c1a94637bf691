"""Spawned body for the asynchronous runtime tests: several runs in one set of processes."""
from __future__ import annotations

from pipeblocks.train.asynchronous.run import async_rank


def async_worker(ctx, cfgs) -> list:
    """Every config's `async_rank` result on this rank, in order."""
    return [async_rank(ctx, cfg) for cfg in cfgs]
