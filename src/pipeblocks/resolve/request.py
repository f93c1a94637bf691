"""What a command asks for: one typed request, built once from the parsed options.

A request names the schedule (a registered name or a file), the generator options, the
cost specification and the mesh. Every command builds its schedule from a request exactly
once (`pipeblocks.resolve.build`), so `show`, `simulate`, `compare`, `plot`, `export` and
`train` agree on what an option means.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..core.ir.dp_units import check_dp_unit, check_prefetch
from ..core.cost.model_shape import ModelShape
from ..core.ir.sharding import ShardingPolicy, parse_sharding
from ..core.cost.split import AUTO, parse_split

__all__ = ["Mesh", "CostSpec", "ScheduleRequest", "RECOMPUTE_MODES"]

RECOMPUTE_MODES = ("none", "all", "auto")


def _positive(name: str, value: object, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}: {fix}")


def _finite(flag: str, value: object, *, positive: bool) -> None:
    """ValueError unless `value` is None or a finite number, > 0 when `positive`, else >= 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value) or (value <= 0 if positive else value < 0)):
        raise ValueError(f"{flag} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


@dataclass(frozen=True)
class Mesh:
    """The device mesh: ranks along each named dimension; world size is their product."""

    pp: int
    """pipeline ranks (stages are placed on them)"""
    dp: int = 1
    """data-parallel replicas of the pipeline, each on its own shard of the global batch"""
    tp: int = 1
    """tensor-parallel ranks inside a stage (`pipeblocks train --tp`; runtime.tensor_parallel)"""

    def __post_init__(self) -> None:
        _positive("p", self.pp, "give -p 1 or more (pipeline ranks)")
        _positive("dp", self.dp, "give 1 or more data-parallel replicas")
        _positive("tp", self.tp, "give 1 or more tensor-parallel ranks")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp


@dataclass(frozen=True)
class CostSpec:
    """Where the costs come from: unit costs, explicit pass times, or the analytic model of a
    preset or given sizes (`model`) or of a Hugging Face model directory (`hf`)."""

    times: str | None = None
    """'TF,TB,TW[,TCOMM]' pass times per full stage (None: unit costs)"""
    mem_w_ratio: float | None = None
    """M_W/M_B, the share of activation B keeps until W (None: 1, or the model's)"""
    model: str | None = None
    """analytic transformer costs: a preset name or 'L,H,A,S[,V[,B]]' (memory then in bytes)"""
    hardware: str = "a100"
    """hardware profile for `model`"""
    flash_attention: bool = False
    """`model`: attention that does not store the s x s scores"""
    seq_split: str = "balanced"
    """sequence chunk boundaries: equal FLOPs ('balanced') or equal tokens ('even')"""
    dp_bandwidth: float | None = None
    """data-parallel link bandwidth override: GB/s under `model`, size units per time unit
    under unit costs (None: the hardware profile's link, or the unit link)"""
    dp_latency: float | None = None
    """data-parallel latency per ring step: microseconds under `model`, time units under
    unit costs (None: the profile's, or 0)"""
    mixed_precision: bool = False
    """static memory and collectives of bf16-mixed (`core.cost.dp_model.Precision`: fp32 master,
    gradient and moments, a bf16 compute copy or bf16 gathered parameters; 4 + 2 + 4 + 8
    bytes per parameter at replicate) instead of fp32 AdamW's 4 + 4 + 8"""
    dp_unit: str = "block"
    """the grain of data-parallel communication (`core.ir.dp_units`): "block" (one gather and
    one reduction per block, pipelined with the passes) or "chunk" (one per chunk)"""
    dp_prefetch: int | None = None
    """at block grain, the zero3 units gathered ahead of a chunk's first pass (`DPCostModel.prefetch`)"""
    hf: str | None = None
    """analytic transformer costs of a Hugging Face model: its directory or config.json, read
    by `core.cost.hf_config.read_hf_config` when the costs are built (`resolve.build.model_config`);
    instead of `model`"""
    seq: int | None = None
    """the analytic model's tokens per sequence (None: the preset's or L,H,A,S's; with `hf`
    its context, at most 4096: `sim.analytic.HF_SEQ`)"""
    microbatch_size: int | None = None
    """the analytic model's sequences per microbatch (None: the preset's or L,H,A,S,V,B's;
    with `hf` 1)"""
    split: tuple[int, ...] | str | None = None
    """transformer layers per global stage, in stage order (`--split 3,4,4,3`), "auto" (the
    simulator chooses them when the request is built: `resolve.split_auto`), or None (the even
    rule, `core.cost.split.layer_counts`). The analytic model prices the stages by them and
    `train` builds its stages with them"""
    shape: ModelShape | None = None
    """analytic costs of this model shape (`train`'s own model, for `--split auto`); instead
    of `model` and `hf`"""
    vocab_parallel: bool = False
    """vocabulary parallelism (`core.ir.vocab`): the embedding and the head split by vocabulary over
    the p ranks, their passes inserted into the schedule; the analytic model prices them"""

    @property
    def analytic(self) -> bool:
        """The costs come from the analytic model (`model`, `hf` or `shape`): seconds and bytes."""
        return bool(self.model or self.hf or self.shape is not None)

    def __post_init__(self) -> None:
        if isinstance(self.split, str) and self.split != AUTO:
            object.__setattr__(self, "split", parse_split(self.split))
        elif self.split is not None and not isinstance(self.split, str):
            object.__setattr__(self, "split", tuple(self.split))
        if self.shape is not None and (self.model is not None or self.hf is not None):
            raise ValueError("give one analytic model: a preset (--model), a Hugging Face directory (--hf) or a shape")
        check_dp_unit(self.dp_unit)
        if self.vocab_parallel and not self.analytic:
            raise ValueError("--vocab-parallel prices the embedding and the head from the model's vocabulary: add "
                             "--model NAME or --hf DIR (unit costs and --costs know no vocabulary)")
        check_prefetch(self.dp_prefetch)
        if self.model is not None and self.hf is not None:
            raise ValueError(f"give either --model ({self.model!r}) or --hf ({self.hf!r}), not both: --hf reads the "
                             "model's sizes from its config.json")
        if self.hf is not None and self.times is not None:
            raise ValueError("give either --hf (analytic costs) or --costs, not both")
        for flag, size in (("--seq", self.seq), ("--microbatch-size", self.microbatch_size)):
            if size is not None:
                _positive(flag, size, f"give {flag} 1 or more")
        if (self.seq is not None or self.microbatch_size is not None) and not self.analytic:
            raise ValueError("--seq and --microbatch-size size the analytic model: give --model or --hf with them")
        _finite("--dp-bandwidth", self.dp_bandwidth, positive=True)
        _finite("--dp-latency", self.dp_latency, positive=False)
        if self.model is not None and self.times is not None:
            raise ValueError("give either --model (analytic costs) or --costs, not both")
        ratio = self.mem_w_ratio
        if ratio is not None and not (math.isfinite(ratio) and 0 <= ratio <= 1):
            raise ValueError(f"--mem-w-ratio must be a number in [0, 1] (M_W <= M_B), got {ratio}")


@dataclass(frozen=True)
class ScheduleRequest:
    """One schedule to build: by `name` through the registry, or loaded from `file`."""

    name: str | None
    """registered schedule name (ignored when `file` is given)"""
    m: int
    """microbatches per step (per pipeline replica)"""
    mesh: Mesh
    """pipeline ranks = mesh.pp"""
    options: tuple[tuple[str, object], ...] = ()
    """generator keyword options (v, group_size, memory_limit, and --set KEY=VALUE), in order"""
    seq_chunks: int | None = None
    """split every microbatch into this many sequence chunks (None: the generator's own)"""
    costs: CostSpec = CostSpec()
    """the cost specification, for the simulator and for cost-aware generators"""
    file: str | None = None
    """a schedule file (.json, .csv, text form) instead of a name"""
    sharding: tuple[ShardingPolicy, ...] = (ShardingPolicy.REPLICATE,)
    """DP sharding policy for every chunk (one entry) or one per chunk, in stage order
    (checked against the stage count when the schedule is built: `sharding.per_stage`)"""
    auto_sharding: bool = False
    """choose the policy per chunk with the simulator when building (`resolve.auto_sharding`);
    the built request's `sharding` then holds the choice"""
    gpu_memory: float | None = None
    """memory per device for `auto_sharding` (static + activation): GB under the analytic
    model, memory units under unit costs (None: no limit)"""
    recompute: str = "none"
    """which forwards to recompute before their backward: "none", "all" (every stage and
    microbatch) or "auto" (the simulator picks pairs so memory fits `gpu_memory`)"""

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"--recompute {self.recompute!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
        if self.name is None and self.file is None:
            raise ValueError(
                "a schedule request needs a schedule name or a file: give a NAME (see `pipeblocks list`) "
                "or --file F (a saved schedule)"
            )
        _positive("m", self.m, "give -m 1 or more (microbatches per step)")
        if self.seq_chunks is not None:
            _positive("--seq-chunks", self.seq_chunks, "give 1 or more sequence chunks")
        _finite("--gpu-memory", self.gpu_memory, positive=True)
        if not isinstance(self.sharding, tuple) or not all(isinstance(p, ShardingPolicy) for p in self.sharding):
            object.__setattr__(self, "sharding", parse_sharding(self.sharding))
        keys = [key for key, _ in self.options]
        repeated = sorted({key for key in keys if keys.count(key) > 1})
        if repeated:
            raise ValueError(f"generator option(s) {repeated} given more than once: give each once")

    @property
    def p(self) -> int:
        return self.mesh.pp

    def with_name(self, name: str) -> ScheduleRequest:
        return dataclasses.replace(self, name=name, file=None)

    def with_options(self, **changes: object) -> ScheduleRequest:
        """The same request with generator options set (replacing any given before)."""
        kept = tuple((k, v) for k, v in self.options if k not in changes)
        return dataclasses.replace(self, options=kept + tuple(changes.items()))
