"""One line each for what a run is, shared by synchronous and asynchronous training.

    >>> describe(cfg)
    '8-layer Llama (hidden 64, 4 heads, 2 KV heads), bf16-mixed, schedule v-half p=2 m=4 v=2, microbatch 4x64 tokens'
    >>> describe_loop(cfg, data)
    'pydoc_data.topics (the last 5% held out); lr cosine 0.003 -> 0.0003 over 30 steps (3 warm-up)'
"""
from __future__ import annotations

from typing import Any

from .config import TrainConfig

__all__ = ["describe", "describe_loop"]


def describe(cfg: TrainConfig) -> str:
    """The model, precision, schedule, microbatch and mesh, for headers and reports."""
    s = cfg.schedule
    return (f"{cfg.model.describe()}, {cfg.precision.name}, schedule {s.name} p={s.p} m={s.m} v={s.v}, microbatch "
            f"{cfg.microbatch_size}x{cfg.model.sequence} tokens"
            + (f" in {s.seq_chunks} chunks {list(s.seq_lengths)}" if s.seq_chunks > 1 else "")
            + (f", layers per stage {','.join(map(str, s.split))}" if s.split is not None else "")
            + (f", dp={cfg.dp} sharding {','.join(map(str, cfg.sharding))}" if cfg.data_parallel else "")
            + (f", tp={cfg.tp}" if cfg.tp > 1 else "")
            + (f" ({cfg.world_size} processes)" if cfg.data_parallel or cfg.tp > 1 else "")
            + (f", on {cfg.mesh.device}" if cfg.mesh.device != "cpu" else ""))


def describe_loop(cfg: TrainConfig, data: Any) -> str:
    """The data, its held-out share and the learning-rate schedule."""
    return (data.source + (f" (the last {cfg.held_out:.0%} held out)" if cfg.held_out else "")
            + f"; lr {cfg.lr_schedule.describe() if cfg.lr_schedule is not None else f'constant {cfg.lr:g}'}")
