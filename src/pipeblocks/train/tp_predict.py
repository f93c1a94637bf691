"""What `train --tp T` predicts before and after a run, from stages profiled whole in one
process (`train --dry-run` and the report of `train`).

    >>> shapes = tp_shapes(cfg, stages)        # global stage -> one tp rank's parameter shapes
    >>> memory = tp_stage_memory(cfg, memory)  # profiled M_B, M_W per stage -> one tp rank's
    >>> f, b, w = tp_emulated_times(cfg)       # --emulate's per-layer ms as a tp rank spends them

Parameters: the family's plan says which dims are split (`runtime.tensor_parallel.planned_shapes`).
Activations: the profiled whole-stage bytes scaled by what one tp rank saves of the
reference GPT's stage, over what one process saves (`sim.tp_memory`, against
`analytic.stage_activation_bytes`): exact for the GPT family (measured), the same
proportions for the Llama families (their gathered GEMM inputs and whole loss are alike).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ..core.cost.dp_model import Link
from ..core.cost.tp_model import TPCostModel
from ..sim.analytic import TransformerConfig, stage_activation_bytes
from ..sim.tp_memory import tp_stage_activation_bytes

__all__ = ["tp_emulated_times", "tp_shapes", "tp_stage_memory"]


def tp_shapes(cfg: Any, stages: Sequence[Any]) -> dict[int, list[tuple[int, ...]]]:
    """Global stage -> the shapes of one tp rank's share of its trainable parameters."""
    from ..models.build import tp_plan_of  # torch: the dry run imports this module without it
    from ..runtime.tensor_parallel import planned_shapes

    plan = tp_plan_of(cfg.model.spec())
    return {st.index: planned_shapes(st, plan, cfg.tp) for st in stages}


def tp_stage_memory(cfg: Any, memory: Sequence[Any]) -> list[Any]:
    """Per stage, the profiled saved-activation bytes (`runtime.memory.StageMemory`) of one tp rank."""
    shape = cfg.model.shape
    analytic = TransformerConfig(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, seq=cfg.model.sequence,
                                 vocab=shape.vocab, microbatch_size=cfg.microbatch_size,
                                 dtype={"bfloat16": "bf16"}.get(cfg.precision.compute, cfg.precision.compute),
                                 flash_attention=True, dropout=False, split=cfg.schedule.split)
    whole = stage_activation_bytes(analytic, cfg.num_stages)
    split = tp_stage_activation_bytes(analytic, cfg.num_stages, cfg.tp)
    out = []
    for x, w, t in zip(memory, whole, split):
        ratio = t / w
        out.append(dataclasses.replace(x, m_b=round(x.m_b * ratio), m_w=round(x.m_w * ratio),
                                       m_in=round(x.m_in / cfg.tp)))
    return out


def tp_emulated_times(cfg: Any) -> tuple[float, float, float]:
    """--emulate's per-layer F, B, W milliseconds (a whole layer's) as one of tp ranks spends
    them: compute over tp, F and B plus the layer's collectives on the emulation's tp link
    (`core.cost.tp_model.TPCostModel`, the simulator's and the planner's)."""
    f, b, w = cfg.emulation.times_ms
    bandwidth, latency = cfg.emulation.tp_link
    activation = cfg.microbatch_size * cfg.model.sequence * cfg.model.hidden * cfg.precision.compute_bytes
    comm_ms = TPCostModel(tp=cfg.tp, link=Link(bandwidth, latency)).layer_comm(activation) * 1e3
    return f / cfg.tp + comm_ms, b / cfg.tp + comm_ms, w / cfg.tp
