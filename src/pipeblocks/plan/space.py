"""What the planner searches: the problem (model, cluster, batch) and its candidate meshes.

A mesh is dp x tp x pp = the GPU count. tp divides the GPUs per node (tensor parallelism
stays on the intra-node link) and the model's heads, KV heads, MLP width, vocabulary and
sequence (`sim.tp_memory.tp_mismatch`); pp is at most the layer count. A
microbatch size b is a candidate for a mesh when dp * b divides the global batch; the
pipeline then runs m = global_batch / (dp * b) microbatches per step.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from ..core.cost.dp_model import resolve_precision
from ..core.ir.dp_units import check_dp_unit
from ..core.cost.precision import PRECISION_NAMES
from ..core.ir.sharding import ShardingPolicy
from ..schedules import get
from ..core.cost.split import AUTO, check_split, rank_balanced
from ..sim.analytic import Hardware, TransformerConfig, transformer_costs
from ..resolve.split_auto import balanced_counts
from ..sim.memory_estimate import W_KEEPS, precision_config
from ..sim.tp_memory import tp_mismatch

__all__ = ["DEFAULT_SCHEDULES", "DEFAULT_MICROBATCH_SIZES", "SEQUENCE_SCHEDULES", "PlanProblem", "MeshShape", "meshes", "microbatch_sizes"]

# The schedules of the Controllable Memory paper's grid (Table 3) and interleaved 1F1B;
# `--schedules` names any registered schedule instead.
DEFAULT_SCHEDULES = ("1f1b", "1f1b-r", "interleaved-1f1b", "zb-1p", "v-min", "v-half", "v-zb")
DEFAULT_MICROBATCH_SIZES = (1, 2, 4, 8)

# zero1 moves more than zero2 (an all-reduce plus the parameter gather, against a
# reduce-scatter plus the gather) but holds less at the step's peak: FSDP2's zero2 and
# zero3 keep their shard beside the gathered parameters, ZeroRedundancyOptimizer does not
SHARDING_ORDER = (ShardingPolicy.REPLICATE, ShardingPolicy.ZERO1, ShardingPolicy.ZERO2, ShardingPolicy.ZERO3)


SEQUENCE_SCHEDULES = {"seq1f1b": "1f1b", "seq1f1b-i": "interleaved-1f1b"}
"""Registered Seq1F1B schedules, and the schedule whose sequence-chunked form each is."""


def _check_count(name: str, value: object, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}: {fix}")


@dataclass(frozen=True)
class PlanProblem:
    """One planning question.

    model: the transformer (its seq is the training sequence length; microbatch_size is
        set per candidate). hardware: device, links and gpus_per_node.
    gpus: GPUs in all. gpu_memory: bytes per GPU. global_batch: sequences per step.
    schedules: registered schedule names to try. microbatch_sizes: the sizes b to try.
    precision: a `core.cost.precision` policy name, as `pipeblocks train --precision` runs it:
        the static memory, the DP traffic and the activations' dtype ("bf16-mixed", also
        "mixed": float32 masters, gradients and AdamW state, a bfloat16 compute copy or
        gathered parameters, 18 bytes per parameter at replicate, bfloat16 activations;
        "fp32": 4 + 4 + 8 and float32 activations; "fp64"). Kept by its policy name.
    seq_chunks: sequence chunk counts to also try (Seq1F1B split of every schedule); empty
        or (1,): none; None (the default): automatic, `search.AUTO_SEQ_CHUNKS` for a
        sequence of `search.LONG_SEQUENCE` tokens or more, or when nothing fits whole.
    tp_degrees: the tensor-parallel degrees allowed (None: every one that fits a node).
    extrapolate: time a long step (m > 4 pp) on the line through simulations at 2 pp and
        4 pp microbatches instead of simulating all m (see `search.EXTRAPOLATE_FROM`).
    intensity: slow small GEMMs by their arithmetic intensity (`plan.intensity`), so the
        microbatch size and tp change the kernels' efficiency; needs the profile's
        memory_bandwidth. Off: the simulator's pass times, one efficiency for every shape.
    w_keeps: what a split backward keeps from B until W: "graph" (pipeblocks' runtime) or
        "weights" (the Zero Bubble paper's M_W); see `sim.memory_estimate.estimate_memory`.
    dp_unit: the grain of the DP collectives (`core.ir.dp_units`), as `train --dp-unit` runs
        them: "block" (the default: a gather and a reduction per layer, pipelined with the
        passes) or "chunk" (one per chunk).
    hf: the Hugging Face model directory the model was read from (`plan --hf`), which the
        printed commands name instead of the model's sizes (None: a preset or given sizes).
    vocab_parallel: also price every schedule with the embedding and the head split by
        vocabulary over its pp ranks (`plan.vocab`; tp = 1, whole sequences, pp >= 2), listed
        as NAME+vocab beside the plain candidates; the ranking keeps whichever wins.
    """

    model: TransformerConfig
    hardware: Hardware
    gpus: int
    gpu_memory: float
    global_batch: int
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    microbatch_sizes: tuple[int, ...] = DEFAULT_MICROBATCH_SIZES
    precision: str = "bf16-mixed"
    seq_chunks: tuple[int, ...] | None = None
    tp_degrees: tuple[int, ...] | None = None
    extrapolate: bool = True
    intensity: bool = True
    w_keeps: str = "graph"
    dp_unit: str = "block"
    hf: str | None = None
    vocab_parallel: bool = False
    split: tuple[int, ...] | str | None = None
    """transformer layers per stage: None (the even rule), counts (`--split 3,4,4,3`: only
    candidates with that many stages), or "auto" (each candidate's stages balanced by pass
    time, the head and its loss included: `resolve.split_auto.balanced_counts`, no extra
    simulation; `simulate --split auto` refines a chosen plan with the simulator)"""

    def __post_init__(self) -> None:
        _check_count("--gpus", self.gpus, "give the number of GPUs to plan for")
        _check_count("--global-batch", self.global_batch, "give the sequences per optimizer step")
        memory = self.gpu_memory
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not math.isfinite(memory) or memory <= 0:
            raise ValueError(f"--gpu-memory must be a finite number of GB > 0, got {memory!r}")
        try:
            object.__setattr__(self, "precision", resolve_precision(self.precision).name)
        except (TypeError, ValueError):
            raise ValueError(
                f"--precision {self.precision!r}: choose one of {', '.join(PRECISION_NAMES)} (mixed: bf16-mixed)"
            ) from None
        if self.w_keeps not in W_KEEPS:
            raise ValueError(f"--w-keeps {self.w_keeps!r}: choose one of {', '.join(W_KEEPS)}")
        check_dp_unit(self.dp_unit)
        if isinstance(self.split, tuple) and (sum(self.split) != self.model.layers or min(self.split) < 1):
            check_split(self.split, layers=self.model.layers, num_stages=len(self.split))  # names the numbers
        if not self.schedules:
            raise ValueError("--schedules is empty: name at least one schedule (see `pipeblocks list`)")
        for name in self.schedules:
            get(name)  # an unknown name is an error listing the known ones
            if name in SEQUENCE_SCHEDULES:
                # the planner prices sequence chunks itself (chunk shares, smaller GEMMs);
                # the name alone would be priced as whole sequences
                raise ValueError(
                    f"--schedules {name}: the planner splits sequences itself; name "
                    f"{SEQUENCE_SCHEDULES[name]} and give --seq-chunks K (e.g. --seq-chunks 2,4) instead"
                )
            if name == "dualpipe":
                # its second direction holds a copy of every stage, which the planner's stage
                # model (p*v distinct stages) and train (which refuses it) do not have
                raise ValueError(
                    "--schedules dualpipe: the planner does not price DualPipe's copies of every stage yet; "
                    "name dualpipev (the same program on the V placement, without copies)"
                )
        if not self.microbatch_sizes:
            raise ValueError("--microbatch-sizes is empty: give at least one size, e.g. 1,2,4")
        for b in self.microbatch_sizes:
            _check_count("a microbatch size", b, "give sizes >= 1, e.g. 1,2,4")
        for k in self.seq_chunks or ():
            _check_count("a sequence chunk count", k, "give counts >= 1, e.g. 2,4")
            if k > self.model.seq:
                raise ValueError(f"--seq-chunks {k} is more than the {self.model.seq} tokens of a sequence")
        if self.intensity and self.hardware.memory_bandwidth is None:
            raise ValueError(
                f"hardware {self.hardware.name!r} has no memory_bandwidth, which the intensity model needs: "
                "give the profile one or use --intensity-model off"
            )
        node = self.hardware.gpus_per_node
        for t in self.tp_degrees or ():
            _check_count("a tp degree", t, "give degrees >= 1, e.g. 1,2,4")
            if t > node:
                raise ValueError(
                    f"--tp {t} is more than the {node} GPUs per node: tensor parallelism's per-layer all-reduces "
                    f"need the intra-node link; give tp <= {node}"
                )

    def stage_split(self, num_stages: int, vocab: bool = False) -> tuple[int, ...] | None:
        """Layers per stage for a candidate of `num_stages` stages (None: the even rule); counts
        that do not fit are a ValueError naming the numbers (`core.cost.split.check_split`). `vocab`:
        a +vocab candidate, whose end stages carry no vocabulary layer: "auto" balances the layers
        per rank (`core.cost.split.rank_balanced`)."""
        if self.split is None:
            return None
        if self.split == AUTO:
            if vocab:
                return rank_balanced(self.model.layers, num_stages)
            return _time_balanced(self.model, self.hardware, num_stages)
        return check_split(self.split, layers=self.model.layers, num_stages=num_stages)

    def staged(self, config: TransformerConfig, num_stages: int, vocab: bool = False) -> TransformerConfig:
        """`config` cut into `num_stages` stages by `stage_split`."""
        split = self.stage_split(num_stages, vocab)
        return config if split is None else dataclasses.replace(config, split=split)

    def config(self, microbatch_size: int) -> TransformerConfig:
        """The model at microbatch size b, its activations in the precision's compute dtype."""
        config, _ = precision_config(dataclasses.replace(self.model, microbatch_size=microbatch_size), self.precision)
        return config


@functools.cache
def _time_balanced(model: TransformerConfig, hardware: Hardware, num_stages: int) -> tuple[int, ...]:
    """The split that balances the stages' F + B + W (`split_auto.balanced_counts`): every
    pass scales with the microbatch, so one microbatch size serves every candidate."""
    costs = transformer_costs(model, hardware, num_stages=num_stages, stage0_input_grad=True)
    totals = [f + b + w for f, b, w in zip(costs.t_f, costs.t_b, costs.t_w)]
    counts = model.stage_layers(num_stages)
    per_layer = totals[0] / counts[0]
    return balanced_counts(model.layers, per_layer, [t - n * per_layer for t, n in zip(totals, counts)])


@dataclass(frozen=True, order=True)
class MeshShape:
    """dp replicas x tp tensor-parallel ranks x pp pipeline ranks."""

    dp: int
    tp: int
    pp: int

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def meshes(problem: PlanProblem) -> list[MeshShape]:
    """Every dp x tp x pp = gpus with tp inside a node and dividing the heads (`tp_mismatch`), pp <= layers
    and some microbatch size that divides the batch per replica. The errors name the
    constraint that left nothing."""
    gpus, node = problem.gpus, problem.hardware.gpus_per_node
    model = problem.model
    allowed = problem.tp_degrees
    tps = [t for t in _divisors(math.gcd(gpus, node)) if tp_mismatch(model, t) is None and (allowed is None or t in allowed)]
    shapes = [
        MeshShape(dp, tp, gpus // (dp * tp))
        for tp in tps for dp in _divisors(gpus // tp)
        if gpus // (dp * tp) <= model.layers
    ]
    if not shapes:
        raise ValueError(
            f"{gpus} GPUs do not divide into any dp x tp x pp mesh: tp must divide both the GPUs per node "
            f"({node}) and the heads ({model.heads}), KV heads ({model.shape.num_kv_heads}), MLP width "
            f"({model.shape.ffn_width}), vocabulary ({model.vocab}) and sequence ({model.seq})"
            f"{'' if allowed is None else f' and be one of --tp {allowed}'}, "
            f"and pp is at most the {model.layers} layers; "
            "choose a GPU count that is a multiple of a pipeline depth <= the layers"
        )
    usable = [shape for shape in shapes if microbatch_sizes(problem, shape)]
    if not usable:
        sizes = ",".join(map(str, problem.microbatch_sizes))
        degrees = sorted({s.dp for s in shapes})
        raise ValueError(
            f"global batch {problem.global_batch} is not divisible by dp x microbatch size for any mesh "
            f"(dp in {degrees}, microbatch sizes {sizes}): choose a batch that is a multiple of "
            f"{min(degrees) * min(problem.microbatch_sizes)} or other --microbatch-sizes"
        )
    return sorted(usable)


def microbatch_sizes(problem: PlanProblem, shape: MeshShape) -> list[int]:
    """The sizes b with dp * b dividing the global batch, smallest first."""
    return sorted(b for b in set(problem.microbatch_sizes) if problem.global_batch % (shape.dp * b) == 0)
