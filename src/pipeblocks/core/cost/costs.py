"""The cost model: how long each pass takes and how much activation it holds.

Scalars are per full pipeline stage (1/p of the model): a chunk that holds 1/v of a stage
takes t/v and stores mem_b/v, so makespans and memory compare across schedules. Per-stage
sequences (one value per global stage) are taken as given, for profiled or analytic costs.

Memory per (stage, microbatch), after the ZB paper: F stores M_B; B keeps M_W = ratio*M_B
until W (the default ratio 1 keeps everything); W or a fused BW frees the rest.

Blocks (`BlockCosts`, optional): per stage, each block's parameters and share of the
pass times, so that data parallelism at block grain (`dp_units`) can gather and reduce
per block while a pass runs through the blocks (F in block order, B and W in reverse).
Without them every stage is one block.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Sequence

from ..ir.actions import Kind
from .dp_model import DPCostModel
from ..ir.dp_units import DPUnits, units_for
from ..ir.errors import ScheduleError
from ..ir.placement import Placement
from ..ir.schedule import Schedule
from ..ir.vocab import VocabCosts

__all__ = ["BlockCosts", "Costs", "StageCosts", "parse_costs", "repeat_stages"]

Value = float | tuple[float, ...]
PerBlock = tuple[tuple[float, ...], ...]


def _check_shares(name: str, table: PerBlock, counts: tuple[int, ...]) -> None:
    if tuple(len(x) for x in table) != counts:
        raise ScheduleError(f"block costs {name} have {tuple(len(x) for x in table)} blocks per stage, the "
                            f"parameters {counts}: give one value per block of every stage")
    for stage, shares in enumerate(table):
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 for x in shares):
            raise ScheduleError(f"block costs {name} of stage {stage} must be finite shares >= 0, got {shares}")
        if shares and not math.isclose(sum(shares), 1.0, rel_tol=1e-9, abs_tol=1e-12) and sum(shares) > 0:
            raise ScheduleError(f"block costs {name} of stage {stage} must sum to 1 (a share of the stage's pass "
                                f"time per block), got {sum(shares):g}")


@dataclass(frozen=True)
class BlockCosts:
    """Per global stage, its blocks in order: parameters (the first block of the first
    stage holds the embedding, the last block of the last stage the head) and each block's
    share of the stage's F, B and W times (shares sum to 1 per stage).

        >>> BlockCosts.even((2, 2), params=(10.0, 12.0)).params
        ((5.0, 5.0), (6.0, 6.0))
    """

    params: PerBlock
    f: PerBlock
    b: PerBlock
    w: PerBlock

    def __post_init__(self) -> None:
        counts = tuple(len(x) for x in self.params)
        if any(n < 1 for n in counts):
            raise ScheduleError(f"block costs: every stage needs at least one block, got {counts} per stage")
        for stage, values in enumerate(self.params):
            if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0
                   for x in values):
                raise ScheduleError(f"block parameters of stage {stage} must be finite and >= 0, got {values}")
        for name in ("f", "b", "w"):
            _check_shares(name, getattr(self, name), counts)

    @classmethod
    def even(cls, blocks: tuple[int, ...], params: tuple[float, ...]) -> BlockCosts:
        """`blocks[s]` equal blocks in stage s, sharing its `params[s]` and its pass times."""
        if len(blocks) != len(params):
            raise ScheduleError(f"{len(blocks)} block counts for {len(params)} stages: give one per stage")
        table = tuple((1.0 / n,) * n for n in blocks)
        return cls(tuple((p / n,) * n for n, p in zip(blocks, params)), table, table, table)

    @property
    def counts(self) -> tuple[int, ...]:
        """Blocks per stage."""
        return tuple(len(x) for x in self.params)


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
    overlap: the time an overlapped forward-backward pair (`program.Overlap`) hides, per
        full stage and scaled like the pass times: a pair takes its forward plus its fused
        backward minus this (at most the shorter part). 0 by default, and on a CPU: the
        parts run one after the other; communication that one part's compute hides (the
        all-to-all of expert parallelism, DeepSeek-V3) is what a positive value declares.
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
    overlap: Value = 0.0
    blocks: BlockCosts | None = None
    """per stage, its blocks' parameters and shares of the pass times (None: one block per
    stage); data parallelism at block grain communicates per block (`dp_units`)"""
    vocab: VocabCosts | None = None
    """vocabulary parallelism (`vocab.py`): the prices of the IF, S, T and IB passes every rank
    runs per microbatch and of their collectives (None: the vocabulary layers stay on the end
    stages, priced in their stages' t_f/t_b/t_w); lowering then adds the passes (`vocab_place`)"""

    def __post_init__(self) -> None:
        for name in ("t_f", "t_b", "t_w", "t_comm", "mem_b", "mem_w_ratio", "params", "t_step", "recompute_input_ratio",
                     "overlap"):
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
        return self.resolve(schedule.placement, schedule.seq_chunks, schedule.chains)

    def resolve(self, placement: Placement, seq_chunks: int = 1, chains: int = 1) -> StageCosts:
        """Per-global-stage tables for `placement` (generators call this before a schedule exists).
        chains: independent pipelines over the stages (DualPipe's 2), each stage of one then
        holding chains/v of a full stage (scalars scale by it)."""
        S = placement.num_stages
        frac = placement.stage_fraction * chains

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

        blocks = self.blocks
        if blocks is not None and len(blocks.params) != S:
            raise ScheduleError(
                f"block costs are given for {len(blocks.params)} stages but the placement has {S}: build them for "
                "the schedule's stage count"
            )
        units = self.dp_units(S)
        return StageCosts(
            placement=placement,
            f=per_stage("t_f", frac), b=per_stage("t_b", frac), w=per_stage("t_w", frac),
            mem_b=per_stage("mem_b", frac), mem_w_ratio=per_stage("mem_w_ratio", 1.0), t_comm=self.t_comm,
            seq_time=_shares(self.seq_time, seq_chunks, "seq_time"),
            seq_mem=_shares(self.seq_mem, seq_chunks, "seq_mem"),
            params=per_stage("params", frac), data_parallel=self.data_parallel,
            step=per_stage("t_step", frac),
            recompute_input_ratio=per_stage("recompute_input_ratio", 1.0),
            blocks=blocks, units=units, vocab=self.vocab, overlap=per_stage("overlap", frac),
        )

    def dp_units(self, num_stages: int) -> DPUnits | None:
        """The DP units of `num_stages` stages under these costs' grain and blocks (None at
        chunk grain): what lowering needs (`lowering.lower_for(units=...)`)."""
        blocks = self.blocks.counts if self.blocks is not None else (1,) * num_stages
        if len(blocks) != num_stages:
            raise ScheduleError(f"block costs are given for {len(blocks)} stages but the schedule has {num_stages}")
        return units_for(self.data_parallel.unit, blocks, prefetch=self.data_parallel.prefetch)

    def with_sharding(self, policies: tuple) -> Costs:
        """These costs with `policies` (one, or one per chunk) as their data-parallel sharding."""
        return dataclasses.replace(self, data_parallel=dataclasses.replace(self.data_parallel, sharding=policies))


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
    blocks: BlockCosts | None = None
    units: DPUnits | None = None
    """the DP units (None: chunk grain), from the DP model's grain and the blocks"""
    vocab: VocabCosts | None = None
    """the vocabulary passes' prices (`Costs.vocab`)"""
    overlap: tuple[float, ...] = ()
    """per stage, the time an overlapped pair hides (`Costs.overlap`)"""

    def unit_params(self, stage: int, unit: int | None) -> float:
        """Parameters of `unit` of `stage` (None: the whole stage)."""
        if unit is None:
            return self.params[stage]
        if self.units is None or self.blocks is None:
            raise ScheduleError(
                f"a DP op names unit {unit} of stage {stage} but the costs have no blocks at block grain: simulate "
                "with Costs(blocks=..., data_parallel=DPCostModel(unit='block')) as the Program was lowered"
            )
        return self.params[stage] * _group(self.blocks.params[stage], self.units.blocks_of(stage, unit), True)

    def unit_shares(self, kind: Kind, stage: int) -> tuple[float, ...]:
        """Each unit's share of a `kind` pass of `stage`, in unit order."""
        units, blocks = self.units, self.blocks
        if units is None or blocks is None:
            return (1.0,)
        ranges = [units.blocks_of(stage, u) for u in range(units.count(stage))]
        if kind is Kind.BW:
            tb, tw = self.b[stage], self.w[stage]
            total = tb + tw
            if total <= 0:
                return tuple(_group(blocks.f[stage], r, False) for r in ranges)
            return tuple((tb * _group(blocks.b[stage], r, False) + tw * _group(blocks.w[stage], r, False)) / total
                         for r in ranges)
        table = blocks.b if kind is Kind.B else blocks.w if kind is Kind.W else blocks.f
        return tuple(_group(table[stage], r, False) for r in ranges)

    def duration(self, kind: Kind, stage: int, seq_chunk: int = 0) -> float:
        share = self.seq_time[seq_chunk]
        if kind is Kind.F:
            return self.f[stage] * share
        if kind is Kind.B:
            return self.b[stage] * share
        if kind is Kind.W:
            return self.w[stage] * share
        return (self.b[stage] + self.w[stage]) * share

    def pair_duration(self, forward_stage: int, backward_stage: int) -> float:
        """An overlapped pair: the forward of one stage plus the fused backward of another,
        less what the overlap hides (the smaller of the two stages' values, at most the
        shorter part)."""
        f, bw = self.duration(Kind.F, forward_stage), self.duration(Kind.BW, backward_stage)
        if not self.overlap:
            return f + bw
        hidden = min(self.overlap[forward_stage], self.overlap[backward_stage], f, bw)
        return f + bw - hidden

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


def _group(values: tuple[float, ...], blocks: range, normalise: bool) -> float:
    """The sum of `values` over `blocks`; with `normalise`, as a share of all of them."""
    part = sum(values[i] for i in blocks)
    if not normalise:
        return part
    total = sum(values)
    return part / total if total > 0 else 1.0 / len(values) * len(blocks)


def _shares(value: Sequence[float] | None, k: int, name: str) -> tuple[float, ...]:
    if value is None:
        return (1.0 / k,) * k
    if len(value) != k:
        raise ScheduleError(f"{name} has {len(value)} shares but the schedule has {k} sequence chunks")
    return tuple(float(x) for x in value)


def repeat_stages(costs: Costs, chains: int) -> Costs:
    """Per-stage `costs` of the model's stages, repeated for a schedule of `chains` chains
    (DualPipe: stage s + k*L is a copy of model stage s, L stages per chain); scalars stay."""
    if chains == 1:
        return costs
    tiled = {name: getattr(costs, name) * chains for name in (
        "t_f", "t_b", "t_w", "mem_b", "mem_w_ratio", "params", "t_step", "recompute_input_ratio", "overlap")
        if isinstance(getattr(costs, name), tuple)}
    blocks = costs.blocks
    if blocks is not None:
        tiled["blocks"] = BlockCosts(blocks.params * chains, blocks.f * chains, blocks.b * chains, blocks.w * chains)
    return dataclasses.replace(costs, **tiled)


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
