"""Checkpoints of an asynchronous run: taken only when the pipeline is drained.

    save_async(cfg, rank=r, step=k, stages=stages, meta=meta)   # every rank, at a drained step k
    k = resume_async(cfg, ctx, stages, data_source)             # every rank: verify, agree, restore

A drained pipeline has no microbatch in flight and every stage at version k (k steps
taken), so a rank's state is its stages' weights, each stage's own AdamW state and the
mode's state (`AsyncStage.state`: the version, T2's and nesterov's velocity average; T1's
rate follows from the step, and the learning-rate schedule is in the run description).
The files are the synchronous run's (`train.checkpoint`: written atomically, a manifest
with size and sha256 last, verified before use, the newest step intact on every rank
agreed), with the mode's state under "extra" and the mode in the run description, so a
resume with another mode or p is refused before launch (`loop_options.check_same_kind`).
"""
from __future__ import annotations

from collections.abc import Mapping

from .. import checkpoint as ckpt
from ..config import TrainConfig
from .stage import AsyncStage

__all__ = ["StageOptimizers", "resume_async", "save_async"]


class StageOptimizers:
    """Every stage's optimizer of a rank, saved and loaded as one (`state_dict` by stage)."""

    def __init__(self, stages: Mapping[int, AsyncStage]) -> None:
        self.stages = stages

    def state_dict(self) -> dict:
        return {s: st.optimizer.state_dict() for s, st in self.stages.items()}

    def load_state_dict(self, state: Mapping) -> None:
        for s, st in self.stages.items():
            st.optimizer.load_state_dict(state[s])


def save_async(cfg: TrainConfig, *, rank: int, step: int, stages: Mapping[int, AsyncStage], meta: dict) -> None:
    """Save this rank's drained state after `step` steps."""
    ckpt.save_rank(cfg.checkpoint.directory, rank=rank, step=step, stages={s: st.module for s, st in stages.items()},
                   optimizer=StageOptimizers(stages), meta=meta,
                   extra={"async": {s: st.state() for s, st in stages.items()}})


def resume_async(cfg: TrainConfig, ctx, stages: Mapping[int, AsyncStage], data_source: str) -> int:
    """Verify this rank's checkpoints, agree on a step with the other ranks, restore it (a
    collective); return the step to run next."""
    state = ckpt.load_agreed(cfg.checkpoint.directory, rank=ctx.rank, world_size=ctx.world_size,
                             meta=cfg.meta(data_source))
    done = ckpt.restore_rank(state, {s: st.module for s, st in stages.items()}, StageOptimizers(stages))
    for s, st in stages.items():
        st.load_state(state["extra"]["async"][s])
    return done
