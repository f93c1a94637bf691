"""Shared by the tensor-parallel memory test: the rank worker (spawned processes import it
by name). For each TrainConfig it trains (train.loop.train_rank) and, on the ranks holding
stage 0, returns the shape of what stage 0 sends to stage 1 (one forward on the step's
first microbatch)."""
from __future__ import annotations

import torch


def tp_memory_worker(ctx, cfgs: list) -> list:
    from pipeblocks.train.loop import train_rank
    from pipeblocks.train.rank_setup import setup_rank

    out = []
    for cfg in cfgs:
        result = train_rank(ctx, cfg)
        setup = setup_rank(ctx, cfg)
        sent = None
        if 0 in setup.modules:
            x, _ = setup.data.batch(0, cfg.microbatch_size, seed=cfg.seed)
            with torch.no_grad():
                sent = tuple(setup.modules[0](x.to(ctx.device)).shape)
        out.append((result, sent))
    return out
