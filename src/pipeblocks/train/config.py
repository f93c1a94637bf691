"""What one `pipeblocks train` run is: a typed, frozen config in sections (no torch here).

    >>> from pipeblocks.schedules import get
    >>> cfg = TrainConfig(model=ModelChoice("llama", LlamaConfig(layers=4)), schedule=ScheduleSpec(get("v-half")(p=2, m=4)),
    ...                   precision=precision_policy("bf16-mixed"), steps=40)
    >>> cfg.schedule.p, cfg.schedule.schedule        # the section answers what the schedule answers
    (2, Schedule(...))
    >>> cfg.batch_size, cfg.tokens_per_step
    (16, 1024)

Sections, each holding resolved values only (`train.run.prepare` resolves them once, from
the command line or a request; nothing here calls into the simulator):

    model       ModelChoice: a built-in family and its config, a Hugging Face directory, or a user's ModelSpec
    schedule    ScheduleSpec: the schedule, its sequence-chunk lengths, the recomputed pairs
    mesh        MeshSpec: data-parallel replicas, sharding per chunk, tensor-parallel ranks, the device type
    precision   core.cost.precision.PrecisionPolicy: fp32, fp64 or bf16-mixed
    checkpoint  CheckpointSpec: where and when to save, whether to resume (None: no checkpoints)
    emulation   EmulationSpec: sleep instead of computing (None: real compute)

and the loop's own settings (microbatch size, steps, learning rate and its schedule, seed,
data, its tokenizer and its held-out share, evaluation, the metrics file, clipping,
timeouts, the asynchronous mode, the Hugging Face export) as plain fields.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..core.lowering.async_mode import AsyncMode
from ..core.cost.precision import PrecisionPolicy, precision_policy
from ..core.ir.schedule import Schedule
from ..core.ir.dp_units import check_dp_unit
from ..core.ir.sharding import ShardingPolicy, per_stage
from ..core.cost.split import layer_counts, stage_layers
from .lr_schedule import LRSchedule
from .model_choice import ModelChoice

__all__ = [
    "CheckpointSpec", "DataSpec", "EmulationSpec", "MeshSpec", "ModelChoice", "ScheduleSpec", "TrainConfig",
    "threads_per_rank",
]


def threads_per_rank(local_ranks: int, cores: int | None = None) -> int:
    """torch threads in each of `local_ranks` processes sharing this machine's `cores` (default
    os.cpu_count()): the cores divided among them, at least 1. `pipeblocks train` gives its
    ranks this, and `pipeblocks calibrate --ranks` times with it, so that a profile prices a
    pass as a rank runs it."""
    if isinstance(local_ranks, bool) or not isinstance(local_ranks, int) or local_ranks < 1:
        raise ValueError(f"local ranks must be an integer >= 1, got {local_ranks!r}")
    return max(1, (cores if cores is not None else os.cpu_count() or 1) // local_ranks)


@dataclass(frozen=True)
class ScheduleSpec:
    """The schedule each rank runs, with what prepare resolved for it."""

    schedule: Schedule
    seq_lengths: tuple[int, ...] | None = None
    """tokens per sequence chunk (None without sequence chunks)"""
    recompute: frozenset[tuple[int, int]] = frozenset()
    """(stage, microbatch) pairs whose forward keeps only its input and is re-run before its
    backward: --recompute's, or the schedule's own (`1f1b-r`: all)"""
    recompute_at: tuple = ()
    """((stage, microbatch, chunk), action) for each recomputation the simulator moved into
    idle time (`resolve.recompute_place`): it runs before that action, the others just before
    their backward"""
    split: tuple[int, ...] | None = None
    """transformer layers of every global stage, in stage order (--split, or what --split
    auto chose); None: the even rule (`core.cost.split.layer_counts`)"""
    vocab_parallel: bool = False
    """--vocab-parallel: the embedding and head split by vocabulary rows over the pipeline
    ranks, their passes placed into the Program (train/vocab_setup.py)"""

    def __post_init__(self) -> None:
        k = self.schedule.seq_chunks
        if (self.seq_lengths is None) != (k == 1) or (self.seq_lengths is not None and len(self.seq_lengths) != k):
            raise ValueError(f"schedule {self.schedule.name!r} has {k} sequence chunks but seq_lengths is "
                             f"{self.seq_lengths!r}: give {k} lengths (None for 1)")
        if self.split is not None:
            object.__setattr__(self, "split", tuple(int(n) for n in self.split))
            if len(self.split) != self.schedule.num_stages or min(self.split) < 1:
                raise ValueError(f"split {list(self.split)}: give {self.schedule.num_stages} layer counts, each >= 1")
        object.__setattr__(self, "recompute", frozenset((int(s), int(mb)) for s, mb in self.recompute))
        at = self.recompute_at.items() if isinstance(self.recompute_at, dict) else self.recompute_at
        object.__setattr__(self, "recompute_at", tuple(sorted(((tuple(u), a) for u, a in at), key=lambda x: x[0])))
        if self.recompute and k > 1:
            raise ValueError(
                f"the runtime does not recompute sequence chunks (schedule {self.schedule.name!r} cuts sequences into "
                f"{k}): a chunk's recomputation would append its K/V twice; drop --recompute "
                "(or use 1f1b instead of 1f1b-r) or --seq-chunks"
            )

    @property
    def recompute_anchors(self) -> dict:
        """`recompute_at` as the mapping `lower_for(recompute_at=)` takes."""
        return dict(self.recompute_at)

    # what the schedule answers, asked of its section
    @property
    def name(self) -> str:
        return self.schedule.name

    @property
    def p(self) -> int:
        return self.schedule.p

    @property
    def m(self) -> int:
        return self.schedule.m

    @property
    def v(self) -> int:
        return self.schedule.v

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def seq_chunks(self) -> int:
        return self.schedule.seq_chunks

    @property
    def placement(self):
        return self.schedule.placement


@dataclass(frozen=True)
class MeshSpec:
    """Where the ranks run: p pipeline ranks (the schedule's) x dp replicas x tp tensor-parallel
    ranks, on one device type."""

    dp: int = 1
    """data-parallel replicas of the pipeline: p x dp x tp processes; a step trains on dp x m microbatches"""
    sharding: tuple[ShardingPolicy, ...] = (ShardingPolicy.REPLICATE,)
    """the sharding policy of every chunk (one, or one per stage)"""
    device: str = "cpu"
    """"cpu" or "cuda" (resolved from --device auto|cpu|cuda before launch)"""
    threads_per_rank: int | None = None
    """torch threads in each rank (None: the cores divided among the ranks on this machine)"""
    tp: int = 1
    """tensor-parallel ranks per stage (runtime.tensor_parallel); 1: none"""
    dp_unit: str = "block"
    """the grain of the DP collectives (core.ir.dp_units): "block" (one per block) or "chunk" (one per chunk)"""

    def __post_init__(self) -> None:
        for name, value in (("--dp", self.dp), ("--tp", self.tp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: resolve --device to cpu or cuda before building the config")
        object.__setattr__(self, "sharding", tuple(ShardingPolicy(p) for p in self.sharding))
        check_dp_unit(self.dp_unit)

    @property
    def data_parallel(self) -> bool:
        """Whether ranks run with a mesh and per-chunk sharding (more than one replica, or a
        policy other than replicate)."""
        return self.dp > 1 or any(p is not ShardingPolicy.REPLICATE for p in self.sharding)


@dataclass(frozen=True)
class CheckpointSpec:
    """Per-rank (or, with data parallelism, torch.distributed.checkpoint) checkpoints."""

    directory: str
    resume: bool = False
    """continue from the newest complete checkpoint in `directory`"""
    save_every: int = 0
    """also save every this many steps (0: only after the last step, and when a run stops early)"""
    overwrite: bool = False
    """a new run may replace the checkpoints of another run in `directory` (else it refuses)"""

    def __post_init__(self) -> None:
        if not self.directory:
            raise ValueError("a checkpoint directory must be named: --checkpoint DIR")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {self.save_every}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the checkpoints that --overwrite would replace: choose one")


@dataclass(frozen=True)
class EmulationSpec:
    """Sleep instead of computing: the runtime's own overhead and bubbles, on a small machine."""

    times_ms: tuple[float, float, float]
    """(F, B, W) milliseconds per layer per microbatch"""
    link: tuple[float, float] | None = None
    """with dp > 1: the DP link (bytes per second, seconds per ring step) each DP collective
    also takes its modelled time on"""
    tp_link: tuple[float, float] | None = None
    """with tp > 1: the intra-node link (bytes per second, seconds per ring step) on which each
    pass's tensor-parallel collectives take their modelled time (train.tp_predict); the
    times_ms are then a whole layer's, of which each tp rank computes 1/tp"""

    def __post_init__(self) -> None:
        if len(self.times_ms) != 3 or any(not math.isfinite(t) or t < 0 for t in self.times_ms):
            raise ValueError(f"emulated times {self.times_ms!r}: give three finite milliseconds F,B,W >= 0")


@dataclass(frozen=True)
class DataSpec:
    """What the run trains on, and how its text becomes tokens (`pipeblocks.data.load_tokens`)."""

    path: str | None = None
    """a text or JSONL file, a token file or a directory of them, a datasets directory; None: the embedded corpus"""
    tokenizer: str | None = None
    """a tokenizer directory or tokenizer.json; None: UTF-8 bytes (256 ids)"""
    field: str = "text"
    """the JSONL (or datasets) field holding a document"""
    dtype: str = "uint16"
    """a pre-tokenized token file's element type: uint16 or uint32"""

    def __post_init__(self) -> None:
        if self.dtype not in ("uint16", "uint32"):
            raise ValueError(f"--data-dtype {self.dtype!r}: choose uint16 or uint32")
        if not isinstance(self.field, str) or not self.field:
            raise ValueError("--data-field needs a field name, e.g. text")


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults are visible here and in `pipeblocks train --help`."""

    model: ModelChoice
    schedule: ScheduleSpec
    mesh: MeshSpec = field(default_factory=MeshSpec)
    precision: PrecisionPolicy = field(default_factory=lambda: precision_policy("fp32"))
    checkpoint: CheckpointSpec | None = None
    emulation: EmulationSpec | None = None
    microbatch_size: int = 4
    """sequences per microbatch b; a step trains on m*b sequences per replica"""
    steps: int = 40
    """train until this many optimizer steps are done (counting steps before a resume)"""
    lr: float = 3e-3
    seed: int = 0
    """seeds the weights and the data order"""
    data: DataSpec = field(default_factory=DataSpec)
    """the corpus and its tokenizer (DataSpec: the embedded corpus, bytes, by default)"""
    save_hf: str | None = None
    """after the last step, write the trained model here as a Hugging Face directory (None: no export)"""
    verify: bool = False
    """run one step and return every gradient, for comparison with one process"""
    timeout_s: float = 300.0
    """a receive, a collective or one step of a rank that makes no progress this long stops the run
    (start-up gets at least 60 s); a run that keeps completing steps is never stopped"""
    quiet: bool = False
    """no per-step progress lines"""
    clip_grad: float | None = None
    """clip the global gradient norm (all ranks) to this; None: no clipping. Either way a step
    whose gradient is non-finite on any rank is skipped on every rank (post_validation.py)"""
    optimistic_step: bool = True
    """step before the global norm is known and undo if needed (AdamW keeps a spare copy of the
    parameters and both moments for it); False: wait for the norm first (a barrier)"""
    inject_nonfinite: int | None = None
    """test hook: make one gradient of the last rank infinite in this step (1-based)"""
    async_mode: AsyncMode | None = None
    """train asynchronously in this mode (no flush; `steps` optimizer steps of m microbatches,
    asynchronous/run.py); None: synchronous training. A pipemare mode without K gets the
    default for the schedule's horizon (`AsyncMode.for_run`)"""
    lr_schedule: LRSchedule | None = None
    """the rate of every step (lr_schedule.py; its peak is `lr`); None: constant `lr`.
    `train.run.prepare` gives a fresh run cosine decay with a warm-up"""
    held_out: float = 0.0
    """the share of the data, at its end, that never trains (`prepare`'s default: 0.05)"""
    eval_every: int = 0
    """every this many steps (and after the last) the loss on the held-out windows; 0: never"""
    metrics: str | None = None
    """a JSON-lines file: one line per step (metrics.py); None: none"""

    def __post_init__(self) -> None:
        for name in ("microbatch_size", "steps", "timeout_s", "lr"):
            value = getattr(self, name)
            # `not value > 0` also rejects NaN, which compares false with everything
            if not value > 0 or value == math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.clip_grad is not None and not (math.isfinite(self.clip_grad) and self.clip_grad > 0):
            raise ValueError(f"clip_grad must be a finite number > 0, got {self.clip_grad!r}")
        if self.inject_nonfinite is not None and not 1 <= self.inject_nonfinite <= self.steps:
            raise ValueError(f"inject_nonfinite must be a step in 1..{self.steps}, got {self.inject_nonfinite!r}")
        object.__setattr__(self, "mesh", MeshSpec(self.mesh.dp, per_stage(self.mesh.sharding, self.num_stages),
                                                  self.mesh.device, self.mesh.threads_per_rank, self.mesh.tp,
                                                  dp_unit=self.mesh.dp_unit))
        if self.precision.master != self.model.weights_dtype:
            raise ValueError(
                f"precision {self.precision.name} keeps {self.precision.master} weights but the model is built in "
                f"{self.model.weights_dtype}: build it in {self.precision.master}"
            )
        if self.async_mode is not None:  # T1's default K: a share of the steps the schedule spans
            object.__setattr__(self, "async_mode", self.async_mode.for_run(self.horizon))
        if self.async_mode is not None and self.async_mode.sync_warmup_steps >= self.steps:
            w = self.async_mode.sync_warmup_steps
            raise ValueError(
                f"--sync-warmup-steps {w} leaves no asynchronous step of --steps {self.steps}: give W < steps "
                f"(W in 0..{self.steps - 1}) or raise --steps"
            )
        if self.lr_schedule is not None and self.lr_schedule.lr != self.lr:
            raise ValueError(f"the schedule's peak rate {self.lr_schedule.lr!r} is not lr {self.lr!r}: build it with lr")
        if isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int) or self.eval_every < 0:
            raise ValueError(f"--eval-every {self.eval_every!r}: give a number of steps >= 1 (0: no evaluation)")
        if self.eval_every and not self.held_out:
            raise ValueError(f"--eval-every {self.eval_every} with --held-out 0: no data is held out to evaluate on; "
                             "give --held-out 0.05, say")

    @property
    def horizon(self) -> int:
        """The steps the learning-rate schedule is made for (--lr-decay-steps, else --steps)."""
        return self.steps if self.lr_schedule is None else self.lr_schedule.total_steps

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        return self.lr if self.lr_schedule is None else self.lr_schedule.rate(step)

    # ---- shorthands ----------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Transformer layers of every global stage: the schedule section's split, or the even
        rule; what the ranks build, the dry run profiles and emulation sleeps for. DualPipe's
        chains: the model's stages once per chain (`stage_copies.copy_layers`)."""
        if self.schedule.schedule.chains > 1:
            from .stage_copies import copy_layers

            return copy_layers(self.model.layers, self.schedule.schedule)
        return stage_layers(self.model.layers, self.num_stages, self.schedule.split)

    @property
    def dp(self) -> int:
        return self.mesh.dp

    @property
    def sharding(self) -> tuple[ShardingPolicy, ...]:
        return self.mesh.sharding

    @property
    def data_parallel(self) -> bool:
        return self.mesh.data_parallel

    @property
    def tp(self) -> int:
        return self.mesh.tp

    @property
    def world_size(self) -> int:
        return self.schedule.p * self.mesh.dp * self.mesh.tp

    def threads_for(self, processes: int) -> int:
        """torch threads in each of `processes` processes sharing this machine: the mesh's
        threads_per_rank when given, else the cores divided among them."""
        return self.mesh.threads_per_rank or threads_per_rank(processes)

    @property
    def batch_size(self) -> int:
        """Sequences per step of one pipeline replica (m microbatches)."""
        return self.schedule.m * self.microbatch_size

    @property
    def global_batch_size(self) -> int:
        """Sequences per step over all replicas: dp x m microbatches; replica r trains on the
        r-th slice of `batch_size` sequences."""
        return self.mesh.dp * self.batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.model.sequence

    def meta(self, data_source: str) -> dict:
        """What a checkpoint must agree on to be resumed by this run."""
        s = self.schedule
        return {
            "model": self.model.config.to_json() if self.model.builtin else self.model.to_json(),
            "schedule": s.name, "p": s.p, "m": s.m,
            "placement": list(s.placement.stage_to_rank), "microbatch_size": self.microbatch_size,
            "lr": self.lr, "seed": self.seed, "data": data_source, "clip_grad": self.clip_grad,
            "seq_chunks": s.seq_chunks, "seq_lengths": list(self.schedule.seq_lengths or ()),
            **({"family": self.model.family} if self.model.family != "gpt" else {}),
            **({"tokenizer": self.data.tokenizer} if self.data.tokenizer is not None else {}),
            # the reference GPT's fused qkv weight has been grouped by head (tensor parallelism's
            # split): a checkpoint written before holds another layout and is refused by its absence
            **({"qkv_layout": "by-head"} if self.model.family == "gpt" else {}),
            **({"precision": self.precision.name} if self.precision.name not in ("fp32", "fp64") else {}),
            **({"dp": self.dp, "sharding": [str(p) for p in self.sharding]} if self.data_parallel else {}),
            **({"lr_schedule": self.lr_schedule.to_json()} if self.lr_schedule is not None else {}),
            **({"held_out": self.held_out} if self.held_out else {}),
            **({"async": self.async_mode.describe()} if self.async_mode is not None else {}),
            **({"tp": self.tp} if self.tp > 1 else {}),
            # a per-rank checkpoint holds its stages' blocks: another split cannot resume it
            **({"split": list(self.stage_layers)} if self.schedule.schedule.chains == 1 and self.stage_layers
               != layer_counts(self.model.layers, self.num_stages) else {}),  # DualPipe: the even rule only
        }
