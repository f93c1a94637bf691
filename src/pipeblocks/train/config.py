"""What one `pipeblocks train` run is: a typed, frozen config (no torch import here).

    >>> from pipeblocks.schedules import get
    >>> cfg = TrainConfig(schedule=get("v-half")(p=2, m=4), model=GPTConfig(), steps=40)
    >>> cfg.batch_size, cfg.tokens_per_step
    (16, 1024)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..core.recompute import recompute_pairs
from ..core.schedule import Schedule
from ..core.sharding import ShardingPolicy, per_stage
from ..models.config import GPTConfig
from ..core.async_mode import AsyncMode

__all__ = ["TrainConfig"]


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults are visible here and in `pipeblocks train --help`."""

    schedule: Schedule
    """What each rank runs; p processes are launched."""
    model: GPTConfig
    """The reference GPT (vocab must cover the data's tokens: 256 for bytes)."""
    microbatch_size: int = 4
    """Sequences per microbatch b; a step trains on m*b sequences."""
    steps: int = 40
    """Train until this many optimizer steps are done (counting steps before a resume)."""
    lr: float = 3e-3
    seed: int = 0
    """Seeds the weights and the data order."""
    data: str | None = None
    """A text file; None: the embedded corpus (pydoc_data.topics)."""
    checkpoint: str | None = None
    """Directory for per-rank checkpoints; None: no checkpoints."""
    resume: bool = False
    """Continue from the newest complete checkpoint in `checkpoint`."""
    save_every: int = 0
    """Also save every this many steps (0: only after the last step)."""
    overwrite: bool = False
    """A new run may replace the checkpoints of another run in `checkpoint` (else it refuses)."""
    emulate: tuple[float, float, float] | None = None
    """(F, B, W) milliseconds per layer per microbatch: sleep instead of computing (no learning)."""
    emulated_link: tuple[float, float] | None = None
    """Under `emulate` with dp > 1: the DP link (bytes per second, seconds per ring step) whose
    modelled time each DP collective also takes."""
    verify: bool = False
    """Run one step and return every gradient, for comparison with one process."""
    timeout_s: float = 300.0
    """A receive, a collective or one step of a rank that makes no progress this long stops the run
    (start-up gets at least 60 s); a run that keeps completing steps is never stopped."""
    threads_per_rank: int | None = None
    """torch threads in each rank (None: the cores divided among the ranks)."""
    quiet: bool = False
    """No per-step progress lines."""
    seq_split: str = "balanced"
    """With a sequence-chunk schedule: "balanced" (equal FLOPs under causal attention) or "even" chunks."""
    clip_grad: float | None = None
    """Clip the global gradient norm (all ranks) to this; None: no clipping. Either way a step
    whose gradient is non-finite on any rank is skipped on every rank (post_validation.py)."""
    optimistic_step: bool = True
    """Step before the global norm is known and undo if needed (AdamW keeps a spare copy of the
    parameters and both moments for it); False: wait for the norm first (a barrier)."""
    inject_nonfinite: int | None = None
    """Test hook: make one gradient of the last rank infinite in this step (1-based)."""
    dp: int = 1
    """Data-parallel replicas of the pipeline: p x dp processes; a step trains on dp x m microbatches."""
    sharding: tuple[ShardingPolicy, ...] = (ShardingPolicy.REPLICATE,)
    """Sharding policy for every chunk (one) or per chunk (one per stage, in stage order)."""
    recompute: tuple[tuple[int, int], ...] = ()
    """(stage, microbatch) pairs whose forward keeps only its input and is re-run before its
    backward (--recompute); empty: those the schedule asks for (`1f1b-r`: all), else none."""
    async_mode: AsyncMode | None = None
    """Train asynchronously in this mode (no flush; `steps` optimizer steps of m microbatches,
    asynchronous/run.py); None: synchronous training."""

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
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {self.save_every}")
        if self.resume and not self.checkpoint:
            raise ValueError("--resume needs --checkpoint DIR: the directory to resume from")
        if self.schedule.seq_chunks > 1:
            self.seq_lengths()  # k larger than the sequence, or an empty chunk, fails here
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1:
            raise ValueError(f"--dp must be an integer >= 1, got {self.dp!r}")
        object.__setattr__(self, "sharding", per_stage(self.sharding, self.schedule.num_stages))
        object.__setattr__(self, "recompute", tuple(sorted((int(s), int(mb)) for s, mb in self.recompute)))
        if self.recompute_pairs and self.schedule.seq_chunks > 1:
            raise ValueError(
                f"the runtime does not recompute sequence chunks (schedule {self.schedule.name!r} cuts sequences into "
                f"{self.schedule.seq_chunks}): a chunk's recomputation would append its K/V twice; drop --recompute "
                "(or use 1f1b instead of 1f1b-r) or --seq-chunks"
            )
        if self.async_mode is not None and self.async_mode.sync_warmup_steps >= self.steps:
            w = self.async_mode.sync_warmup_steps
            raise ValueError(
                f"--sync-warmup-steps {w} leaves no asynchronous step of --steps {self.steps}: give W < steps "
                f"(W in 0..{self.steps - 1}) or raise --steps"
            )

    @property
    def recompute_pairs(self) -> frozenset[tuple[int, int]]:
        """The pairs the runtime recomputes: `recompute`, or the schedule's own (`1f1b-r`)."""
        return recompute_pairs(self.schedule, self.recompute)

    @property
    def data_parallel(self) -> bool:
        """Whether ranks run with a mesh and per-chunk sharding (more than one replica, or a
        policy other than replicate)."""
        return self.dp > 1 or any(p is not ShardingPolicy.REPLICATE for p in self.sharding)

    @property
    def world_size(self) -> int:
        return self.schedule.p * self.dp

    def threads_for(self, processes: int) -> int:
        """torch threads in each of `processes` processes sharing this machine: threads_per_rank
        when given, else the cores divided among them."""
        return self.threads_per_rank or max(1, (os.cpu_count() or 1) // processes)

    def seq_lengths(self) -> tuple[int, ...] | None:
        """Tokens per sequence chunk (None without sequence chunks), from `seq_split`."""
        k = self.schedule.seq_chunks
        if k == 1:
            return None
        from ..sim.analytic import TransformerConfig
        from ..sim.sequence_split import SPLITS, split_lengths

        if self.seq_split not in SPLITS:
            raise ValueError(f"seq_split must be one of {', '.join(SPLITS)}, got {self.seq_split!r}")
        if k > self.model.seq:
            raise ValueError(
                f"schedule {self.schedule.name!r} cuts every sequence into {k} chunks but sequences have "
                f"{self.model.seq} tokens: use --seq-chunks {self.model.seq} or fewer, or a longer --seq"
            )
        m = self.model
        analytic = TransformerConfig(layers=m.layers, hidden=m.hidden, heads=m.heads, seq=m.seq, vocab=m.vocab)
        lengths = split_lengths(m.seq, k, self.seq_split, analytic)
        if min(lengths) < 1:
            raise ValueError(f"the {self.seq_split} split {list(lengths)} leaves an empty chunk: use fewer chunks")
        return lengths

    @property
    def batch_size(self) -> int:
        """Sequences per step of one pipeline replica (m microbatches)."""
        return self.schedule.m * self.microbatch_size

    @property
    def global_batch_size(self) -> int:
        """Sequences per step over all replicas: dp x m microbatches; replica r trains on the
        r-th slice of `batch_size` sequences."""
        return self.dp * self.batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.model.seq

    def meta(self, data_source: str) -> dict:
        """What a checkpoint must agree on to be resumed by this run."""
        s = self.schedule
        return {
            "model": self.model.to_json(), "schedule": s.name, "p": s.p, "m": s.m,
            "placement": list(s.placement.stage_to_rank), "microbatch_size": self.microbatch_size,
            "lr": self.lr, "seed": self.seed, "data": data_source, "clip_grad": self.clip_grad,
            "seq_chunks": s.seq_chunks, "seq_lengths": list(self.seq_lengths() or ()),
            **({"dp": self.dp, "sharding": [str(p) for p in self.sharding]} if self.data_parallel else {}),
        }
