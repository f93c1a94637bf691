"""The cost model: how long each pass takes and how much activation it holds.

Scalars are per full pipeline stage (1/p of the model): a chunk that holds 1/v of a stage
takes t/v and stores mem_b/v, so makespans and memory compare across schedules. Per-stage
sequences (one value per global stage) are taken as given, for profiled or analytic costs.

Memory per (stage, microbatch), after the ZB paper: F stores M_B; B keeps M_W = ratio*M_B
until W (the default ratio 1 keeps everything); W or a fused BW frees the rest.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

from .actions import Kind
from .dp_model import DPCostModel
from .errors import ScheduleError
from .placement import Placement
from .schedule import Schedule

__all__ = ["Costs", "StageCosts", "parse_costs"]

Value = float | tuple[float, ...]


@dataclass(frozen=True)
class Costs:
    """Durations and activation memory of the passes.

    t_f, t_b, t_w: forward, input-gradient and weight-gradient time; fused BW takes t_b + t_w.
    t_comm: time for one activation or gradient to cross between ranks.
    mem_b: activation that F stores for B (unit model: 1 per full stage).
    mem_w_ratio: M_W / M_B, the share that B keeps until W (a scalar, or one per stage: a
        runtime that splits the autograd graph frees the loss region on the last stage at B).
    seq_time, seq_mem: per sequence chunk, its share of a microbatch's time and memory
        (None: even shares); Seq1F1B's balanced split sets them from token positions.
    params: parameters per full stage (unit model: 1), or one count per stage; they size
        the data-parallel collectives and the static memory.
    data_parallel: the replicas, sharding policies, link and precision (`dp_model`); one
        replica by default, which adds no op and no time.
    t_step: time of one stage's optimizer step (asynchronous programs hold step ops; a
        synchronous one steps after its flush, outside the simulated step).
    recompute_input_ratio: for a (stage, microbatch) whose forward is recomputed, the share
        of M_B its forward keeps (the stage's input); the recomputation adds the other
        1 - ratio back until the backward frees it. Scalar or one per stage; the analytic
        model sets input bytes over activation bytes (about 2h / (layers * (34h + 5as))).
    """

    t_f: Value = 1.0
    t_b: Value = 1.0
    t_w: Value = 1.0
    t_comm: float = 0.0
    mem_b: Value = 1.0
    mem_w_ratio: Value = 1.0
    seq_time: tuple[float, ...] | None = None
    seq_mem: tuple[float, ...] | None = None
    params: Value = 1.0
    data_parallel: DPCostModel = DPCostModel()
    t_step: Value = 0.0
    recompute_input_ratio: Value = 0.05

    def __post_init__(self) -> None:
        for name in ("t_f", "t_b", "t_w", "t_comm", "mem_b", "mem_w_ratio", "params", "t_step", "recompute_input_ratio"):
            value = getattr(self, name)
            values = value if isinstance(value, tuple) else (value,)
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in values):
                raise ScheduleError(f"cost {name} must be a number or a tuple of numbers, got {value!r}")
            if not all(math.isfinite(x) for x in values):
                raise ScheduleError(
                    f"cost {name} must be >= 0 and finite, got {value!r}: NaN or infinity would make every "
                    "time and memory figure meaningless"
                )
            if any(x < 0 for x in values):
                raise ScheduleError(f"cost {name} must be >= 0, got {value!r}: costs are durations and sizes")
        for name in ("seq_time", "seq_mem"):
            shares = getattr(self, name)
            if shares is not None and any(
                isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0
                for x in shares
            ):
                raise ScheduleError(f"{name} must be finite shares >= 0, got {shares!r}")
        ratios = self.mem_w_ratio if isinstance(self.mem_w_ratio, tuple) else (self.mem_w_ratio,)
        if any(r > 1 for r in ratios):
            raise ScheduleError(f"mem_w_ratio must be in [0, 1] (M_W <= M_B), got {self.mem_w_ratio}")
        kept = self.recompute_input_ratio
        if any(r > 1 for r in (kept if isinstance(kept, tuple) else (kept,))):
            raise ScheduleError(
                f"recompute_input_ratio must be in [0, 1] (the input is part of the activation), got {kept}"
            )

    def for_schedule(self, schedule: Schedule) -> StageCosts:
        """Resolve to per-global-stage tables for this schedule."""
        return self.resolve(schedule.placement, schedule.seq_chunks)

    def resolve(self, placement: Placement, seq_chunks: int = 1) -> StageCosts:
        """Per-global-stage tables for `placement` (generators call this before a schedule exists)."""
        S = placement.num_stages
        frac = placement.stage_fraction

        def per_stage(name: str, scale: float) -> tuple[float, ...]:
            value = getattr(self, name)
            if isinstance(value, tuple):
                if len(value) != S:
                    raise ScheduleError(
                        f"cost {name} has {len(value)} per-stage values but the placement has {S} stages: "
                        "give one value per stage or a scalar"
                    )
                return tuple(float(x) for x in value)
            return (float(value) * scale,) * S

        return StageCosts(
            placement=placement,
            f=per_stage("t_f", frac), b=per_stage("t_b", frac), w=per_stage("t_w", frac),
            mem_b=per_stage("mem_b", frac), mem_w_ratio=per_stage("mem_w_ratio", 1.0), t_comm=self.t_comm,
            seq_time=_shares(self.seq_time, seq_chunks, "seq_time"),
            seq_mem=_shares(self.seq_mem, seq_chunks, "seq_mem"),
            params=per_stage("params", frac), data_parallel=self.data_parallel,
            step=per_stage("t_step", frac),
            recompute_input_ratio=per_stage("recompute_input_ratio", 1.0),
        )


@dataclass(frozen=True)
class StageCosts:
    """Costs resolved per global stage (and per sequence chunk share)."""

    placement: Placement
    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    mem_b: tuple[float, ...]
    mem_w_ratio: tuple[float, ...]
    t_comm: float
    seq_time: tuple[float, ...]
    seq_mem: tuple[float, ...]
    params: tuple[float, ...] = ()
    data_parallel: DPCostModel = DPCostModel()
    step: tuple[float, ...] = ()
    """per stage, the time of its optimizer step"""
    recompute_input_ratio: tuple[float, ...] = ()

    def duration(self, kind: Kind, stage: int, seq_chunk: int = 0) -> float:
        share = self.seq_time[seq_chunk]
        if kind is Kind.F:
            return self.f[stage] * share
        if kind is Kind.B:
            return self.b[stage] * share
        if kind is Kind.W:
            return self.w[stage] * share
        return (self.b[stage] + self.w[stage]) * share

    def memory(self, kind: Kind, stage: int, seq_chunk: int = 0) -> tuple[float, float]:
        """(allocated at start, released at end) by this pass; releases are negative."""
        m_b = self.mem_b[stage] * self.seq_mem[seq_chunk]
        if kind is Kind.F:
            return (m_b, 0.0)
        if kind is Kind.B:
            return (0.0, m_b * self.mem_w_ratio[stage] - m_b)
        if kind is Kind.W:
            return (0.0, -m_b * self.mem_w_ratio[stage])
        return (0.0, -m_b)

    def recomputed_share(self, stage: int, seq_chunk: int = 0) -> float:
        """The activation a recomputation adds back: M_B minus the kept input."""
        return self.mem_b[stage] * self.seq_mem[seq_chunk] * (1.0 - self.recompute_input_ratio[stage])


def _shares(value: Sequence[float] | None, k: int, name: str) -> tuple[float, ...]:
    if value is None:
        return (1.0 / k,) * k
    if len(value) != k:
        raise ScheduleError(f"{name} has {len(value)} shares but the schedule has {k} sequence chunks")
    return tuple(float(x) for x in value)


def parse_costs(text: str) -> Costs:
    """Parse 'TF,TB,TW[,TCOMM]' as given on the command line."""
    parts = [x.strip() for x in text.split(",")]
    try:
        values = [float(x) for x in parts]
    except ValueError:
        raise ScheduleError(f"--costs {text!r}: expected numbers TF,TB,TW[,TCOMM], e.g. 1,1,1 or 3,4,2,0.1") from None
    if len(values) not in (3, 4):
        raise ScheduleError(f"--costs {text!r}: expected 3 or 4 numbers TF,TB,TW[,TCOMM], got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        raise ScheduleError(f"--costs {text!r}: costs must be finite numbers (no nan or inf), e.g. 1,1,1")
    if any(v < 0 for v in values):
        raise ScheduleError(f"--costs {text!r}: costs must be >= 0")
    return Costs(t_f=values[0], t_b=values[1], t_w=values[2], t_comm=values[3] if len(values) == 4 else 0.0)
