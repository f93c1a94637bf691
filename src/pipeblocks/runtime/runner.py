"""`PipelineRunner`: the public entry that trains one rank's stages with a schedule.

    runner = PipelineRunner(schedule, {0: stage0}, loss_fn, rank=rank)
    for batch in data:
        result = runner.step(inputs, targets)   # m microbatches; then optimizer.step()
        # or, with tensors every stage needs (the same on every rank; never sent):
        result = runner.step(inputs, targets, side_inputs={"mask": mask})

Activations (stage inputs and outputs) are tensors, or tuples or dicts of tensors; see the
package docstring for how a stage is called with them, and shapes.py for how they cross.

With a sequence-chunk schedule (Seq1F1B, `schedule.seq_chunks` = k > 1) the runner cuts each
microbatch's inputs and targets along dim 1 into k chunks (`seq_lengths`, default even) and
calls each stage with `chunk=` (see the package docstring and sequence.py).

One `step` runs the whole lowered Program of this rank once: the m forwards and backwards,
with parameter gradients accumulated into `.grad` (they are not zeroed: call
`optimizer.zero_grad()` yourself, or pass `optimizer=` to have the runner step and zero
after each flush). The loss is the mean over the m microbatch losses, so with equal
microbatches the gradients equal one process training the whole batch.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..core.lowering import lower_for
from ..core.program import Program
from ..core.recompute import recompute_pairs
from ..core.schedule import Schedule
from ..core.timeline import Timeline
from .comm import Mailbox, Tags
from .compute import ModuleCompute
from .executor import RankExecutor
from .memory import SavedTensorTracker
from .sequence import SequenceChunk, chunk_bounds
from .shapes import ActivationSpec, SpecMismatchError, TensorSpec, decode_specs, encode_specs, flatten, infer_output_spec
from .timeline import gather_timeline

if TYPE_CHECKING:
    from .data_parallel import DataParallel
    from .precision import ComputeCopies

__all__ = ["PipelineRunner", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    """The outcome of one step on this rank.

    loss: mean loss over the m microbatches (on the rank holding the last stage; else None).
    losses: per-microbatch losses (last-stage rank only; else empty).
    peak_saved_bytes: the largest saved-activation footprint of this rank during the step
        (None when the runner does not measure memory).
    wait_s: time this rank spent blocked on receives and on the final send flush.
    duration_s: wall time of the step on this rank.
    timeline: the measured Timeline of all ranks (on group rank 0 when the runner records; else None).
    memory_trace: this rank's (seconds since step start, saved bytes) changes.
    """

    loss: float | None
    losses: tuple[float, ...]
    peak_saved_bytes: int | None
    wait_s: float
    duration_s: float
    timeline: Timeline | None = None
    memory_trace: tuple[tuple[float, int], ...] = field(default=(), repr=False)


class PipelineRunner:
    """Runs `schedule` on this rank with real stage modules.

    schedule: a Schedule (any registered generator's output, or loaded from text/JSON);
        its p must equal the process group's size.
    stages: global stage index -> module, for exactly this rank's stages
        (`schedule.placement.stages_of(rank)`). See the package docstring for the contract.
    loss_fn: `loss_fn(output, target) -> scalar tensor` on the last stage.
    rank: this process's rank in `group` (default: `dist.get_rank(group)`).
    group: the pipeline process group (default: the world).
    device: where inputs, targets and received tensors live (default: the first
        parameter's device, else CPU).
    timeout_s: every wait for a peer gives up after this long with PeerTimeoutError.
    optimizer: if given, `optimizer.step()` and `optimizer.zero_grad()` run after each step.
    record_timeline: gather a measured Timeline to group rank 0 after each step (one
        collective per step).
    compute: replace real modules by another compute object with the same methods
        (`emulate.EmulatedCompute`); the modules are then used only for shape inference.
    seq_lengths: with sequence chunks, the k chunk lengths (tokens; they must sum to the
        sequence length of the step's inputs); None: an even split (earlier chunks get the
        extra token). `pipeblocks.sim.sequence_split.split_lengths` gives balanced ones.
    measure_memory: count saved-activation bytes (a hook on every saved tensor, a few
        percent of a small stage's step time); off, `peak_saved_bytes` is None and the
        memory trace empty. An attribute too: set `runner.measure_memory` between steps to
        measure only the steps that need it (`pipeblocks train` measures the first steps
        and the last, which its report draws).
    data_parallel: this rank's `data_parallel.DataParallel` when the pipeline is one replica
        of several (`group` is then the mesh's pp group): the Program is lowered with its
        DP ops (REDUCE_GRAD, and UNSHARD/RESHARD for zero3 chunks), which it runs; the step
        ends when every reduction is done, so the optimizer may step.
    recompute: (stage, microbatch) pairs whose forward runs without keeping its autograd
        graph (only the stage input and the random state) and is re-run, with the graph,
        just before the pair's backward (`core.recompute.add_recompute` places the RECOMPUTE
        ops); the gradients are those without recomputation. None or none given: every pair
        when the schedule's options say recompute="all" (`1f1b-r`), else none
        (`core.recompute.recompute_pairs`). Not with sequence chunks (ValueError).
    program: a lowered Program of `schedule` to run instead of `core.lowering.lower_for`'s,
        such as an asynchronous one (`pipeblocks.schedules.asynchronous`) whose OPTIMIZER_STEP
        ops go to `compute.optimizer_step(stage, step)`; then one `step` call runs the
        whole Program (all its optimizer steps, one flush at the end).
    precision: a `precision.ComputeCopies` whose `stages` (the `CastStage`s) are among
        `stages`: every step casts their parameters once (`begin_step`) before the first
        pass and drops the copies (`end_step`) when the step's work is done, before the
        optimizer may step; the copies are not counted as activations. Chunks sharded by
        FSDP2 cast through FSDP2's own MixedPrecisionPolicy instead.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, torch.nn.Module],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        timeout_s: float = 300.0,
        optimizer: torch.optim.Optimizer | None = None,
        record_timeline: bool = False,
        compute: object | None = None,
        seq_lengths: Sequence[int] | None = None,
        measure_memory: bool = True,
        data_parallel: DataParallel | None = None,
        recompute: Iterable[tuple[int, int]] | None = None,
        program: Program | None = None,
        precision: ComputeCopies | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: launch with pipeblocks.runtime.launch.spawn(...) or torchrun "
                "and call init_from_env() first"
            )
        world = dist.get_world_size(group)
        if world != schedule.p:
            raise ValueError(
                f"schedule {schedule.name!r} has p={schedule.p} ranks but the process group has {world}: "
                f"launch {schedule.p} processes or build the schedule with p={world}"
            )
        self.seq_lengths = _check_seq_lengths(schedule, seq_lengths)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.schedule = schedule
        self.data_parallel = data_parallel
        self.precision = precision
        if program is not None:
            if program.schedule is not schedule:
                raise ValueError("program= must be lowered from the schedule given: pass program.schedule as schedule")
            if data_parallel is not None or recompute:
                raise ValueError("program= with data_parallel= or recompute= is not supported: their ops come from "
                                 "the lowering; lower them into the program")
            self.recompute = frozenset()
            self.program = program
        else:
            self.recompute = recompute_pairs(schedule, recompute)
            if self.recompute and schedule.seq_chunks > 1:
                raise ValueError(
                    f"schedule {schedule.name!r} cuts sequences into {schedule.seq_chunks} chunks: the runtime does not "
                    "recompute sequence chunks (a chunk's recomputation would append its K/V twice); drop the "
                    "recomputation (--recompute none, or a schedule without -r) or the sequence chunks"
                )
            self.program = _lower(schedule, data_parallel, self.recompute)
        self.rank = dist.get_rank(group) if rank is None else rank
        if self.rank != dist.get_rank(group):
            raise ValueError(f"rank={rank} but this process is rank {dist.get_rank(group)} of the group")
        mine = schedule.placement.stages_of(self.rank)
        if sorted(stages) != list(mine):
            raise ValueError(
                f"rank {self.rank} holds stages {list(mine)} of schedule {schedule.name!r} "
                f"(placement {schedule.placement.shape}), but stages {sorted(stages)} were given"
            )
        self.stages = dict(stages)
        if schedule.seq_chunks > 1:
            _check_chunk_support(schedule, self.stages, compute)
        self.loss_fn = loss_fn
        self.group = group
        self.device = torch.device(device) if device is not None else _module_device(self.stages)
        self.timeout_s = float(timeout_s)
        self.optimizer = optimizer
        self.record_timeline = record_timeline
        self.tracker = SavedTensorTracker(enabled=measure_memory)
        self.compute = compute if compute is not None else ModuleCompute(
            self.stages, loss_fn, schedule.num_stages - 1, schedule.m, self.tracker
        )
        self.mailbox = Mailbox(group, self.timeout_s, self.rank)
        if data_parallel is not None:
            if compute is not None and data_parallel.link is None:
                raise ValueError(
                    "data_parallel with emulated compute needs an emulated link: give DataParallel(..., link="
                    "EmulatedLink(...)), or drop compute="
                )
            data_parallel.compute = self.compute
            data_parallel.tracker = self.tracker
            data_parallel.use_program(self.program.ranks[self.rank])
        self._executor: RankExecutor | None = None
        self._input_specs: list[ActivationSpec] | None = None
        self._side_specs: list[dict[str, TensorSpec]] | None = None

    @property
    def measure_memory(self) -> bool:
        """Whether the next step counts saved-activation bytes (settable between steps)."""
        return self.tracker.enabled

    @measure_memory.setter
    def measure_memory(self, on: bool) -> None:
        self.tracker.enabled = bool(on)

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last_stage(self) -> bool:
        return self.schedule.num_stages - 1 in self.stages

    def step(
        self,
        inputs: Sequence | torch.Tensor | Mapping | None = None,
        targets: Sequence | torch.Tensor | Mapping | None = None,
        side_inputs: Mapping[str, torch.Tensor | Sequence[torch.Tensor]] | None = None,
    ) -> StepResult:
        """Run one step: every action of this rank's Program, then the flush.

        inputs: the stage-0 input of the step's batch, needed only on the rank holding stage
            0: a tensor, or a dict of tensors, each split into m equal parts along dim 0;
            or a list (or tuple) of the m microbatches, each a tensor, a tuple or a dict of
            tensors (a tuple at the top level is the m microbatches, as `x.chunk(m)` gives).
        targets: likewise for the loss targets, on the rank holding the last stage.
        side_inputs: name -> tensor every stage's forward gets as a keyword argument (masks,
            position ids): a tensor of the batch, split into m along dim 0, or a list of m.
            They are not sent between ranks: give the same side inputs on every rank (each
            from its own data loader). With sequence chunks every chunk of a microbatch gets
            the whole microbatch's side inputs (slice them with `chunk.offset`/`chunk.length`).
            Their shapes, like those of the inputs, are fixed by the first step.
        """
        m = self.schedule.m
        xs = _microbatches(inputs, m, "inputs") if self.holds_first_stage else None
        ys = _microbatches(targets, m, "targets") if self.holds_last_stage else None
        side = _side_microbatches(side_inputs, m, self.device)
        side_specs = [{name: TensorSpec.of(t) for name, t in mb.items()} for mb in side] if side else []
        if self._side_specs is not None and side_specs != self._side_specs:
            raise SpecMismatchError(
                f"side inputs have specs {_side_text(side_specs)} but the first step had "
                f"{_side_text(self._side_specs)}: shapes are fixed after the first step; pad the batch or build "
                "a new PipelineRunner"
            )
        self._side_specs = side_specs
        if xs is not None:
            xs = self._cut([_to(x, self.device) for x in xs], "inputs")
            specs = [ActivationSpec.of(x, "the step inputs") for x in xs]
            if self._input_specs is not None and specs != self._input_specs:
                raise SpecMismatchError(
                    f"step inputs have specs {[str(s) for s in specs]} but the first step had "
                    f"{[str(s) for s in self._input_specs]}: shapes are fixed after the first step; pad the "
                    "batch or build a new PipelineRunner"
                )
            self._input_specs = specs
        if ys is not None:
            ys = self._cut([_to(y, self.device) for y in ys], "targets")
        dp = self.data_parallel
        copies = self.precision.begin_step() if self.precision is not None else []
        if self._executor is None:
            self._executor = self._build_executor(xs, side)
            if dp is not None:
                dp.after_shape_pass()
            if ys is not None and self._executor.chunks is not None:
                self._check_target_chunks(ys)
        if self.tracker.enabled:
            self.tracker.exclude([*(p for mod in self.stages.values() for p in mod.parameters()),
                                  *(b for mod in self.stages.values() for b in mod.buffers())])
            self.tracker.also_exclude(copies)  # the weights' compute copies are not activations
        origin = time.perf_counter()
        self.tracker.reset_peak()
        if dp is not None:
            dp.reset_step()
        record = self._executor.run(xs, ys, side)
        if dp is not None:
            dp.finish()
        if self.precision is not None:
            self.precision.end_step()
        duration = time.perf_counter() - origin
        kv_cache = getattr(self.compute, "kv_cache", None)
        if kv_cache is not None and len(kv_cache):
            raise RuntimeError(
                f"rank {self.rank}: the step ended with K/V caches of (stage, microbatch) {kv_cache.in_flight()} "
                "still held: every chunk 0 must run its backward"
            )
        if self.optimizer is not None:
            self.optimizer.step()
            if dp is not None:
                dp.sample_static()
            self.optimizer.zero_grad(set_to_none=True)
        measured = self.tracker.enabled
        trace = tuple((t - origin, b) for t, b in self.tracker.trace) if measured else ()
        timeline = None
        if self.record_timeline:
            timeline = gather_timeline(self.schedule, record, trace, self.tracker.peak if measured else 0, self.group,
                                       origin)
        losses = record.losses
        return StepResult(
            loss=sum(losses) / m if self.holds_last_stage else None,
            losses=losses,
            peak_saved_bytes=self.tracker.peak if measured else None,
            wait_s=record.wait_s,
            duration_s=duration,
            timeline=timeline,
            memory_trace=trace,
        )

    # ---- sequence chunks -------------------------------------------------------
    def _cut(self, parts: list, name: str) -> list:
        """m microbatches -> m*k units (microbatch-major), every tensor cut along dim 1."""
        k = self.schedule.seq_chunks
        if k == 1:
            return parts
        first = flatten(parts[0], name)[1][0]
        seq = first.shape[1] if first.dim() >= 2 else 0
        if seq < k:
            raise ValueError(
                f"{name} have {seq} tokens per sequence (dim 1 of {tuple(first.shape)}) but schedule "
                f"{self.schedule.name!r} cuts every sequence into {k} chunks: use at most {seq} chunks "
                "(--seq-chunks) or longer sequences"
            )
        lengths = self.seq_lengths or _even(seq, k)
        if sum(lengths) != seq:
            raise ValueError(
                f"seq_lengths {list(lengths)} sum to {sum(lengths)} tokens but the {name} have {seq} per sequence: "
                f"give chunk lengths that sum to {seq}"
            )
        units = []
        for part in parts:
            layout, leaves = flatten(part, name)
            for leaf in leaves:
                if leaf.dim() < 2 or leaf.shape[1] != seq:
                    raise ValueError(
                        f"{name} hold a tensor of shape {tuple(leaf.shape)} beside one of {seq} tokens (dim 1): "
                        "with sequence chunks every tensor of the inputs and targets is [batch, tokens, ...]; "
                        "pass other tensors as side inputs"
                    )
            # clones: each unit owns its storage, so what autograd saves of it is freed with the unit
            units += [layout.build([leaf[:, a:a + n].clone() for leaf in leaves]) for a, n in chunk_bounds(lengths)]
        return units

    def _check_target_chunks(self, ys: list[torch.Tensor]) -> None:
        last = self.schedule.num_stages - 1
        k = self.schedule.seq_chunks
        for mb in range(self.schedule.m):
            for c in range(k):
                chunk = self._executor.chunks[(last, mb, c)]
                length = flatten(ys[mb * k + c])[1][0].shape[1]
                if length != chunk.length:
                    raise ValueError(
                        f"rank {self.rank}: targets of microbatch {mb}, chunk {c} have {length} "
                        f"tokens but the last stage receives {chunk.length}: give every rank the same seq_lengths"
                    )

    # ---- first step: shapes ---------------------------------------------------
    def _build_executor(self, xs: list | None, side: list[dict] | None) -> RankExecutor:
        schedule = self.schedule
        if dist.get_backend(self.group) != "gloo":
            # NCCL wants every rank in the first call of a communicator; p2p calls come later
            dist.barrier(group=self.group)
        placement = schedule.placement
        S, m, k = schedule.num_stages, schedule.m, schedule.seq_chunks
        tags = Tags(S, m, k)
        in_specs: dict[int, list[ActivationSpec]] = {}
        out_specs: dict[int, list[ActivationSpec]] = {}
        for stage in placement.stages_of(self.rank):
            if stage == 0:
                specs = [ActivationSpec.of(x) for x in xs]
            elif placement.rank_of(stage - 1) == self.rank:
                specs = out_specs[stage - 1]
            else:
                specs = self._receive_specs(stage, placement.rank_of(stage - 1), tags)
            in_specs[stage] = specs
            out_specs[stage] = self._infer(stage, specs, side)
            if stage < S - 1 and placement.rank_of(stage + 1) != self.rank:
                self._send_specs(stage + 1, out_specs[stage], placement.rank_of(stage + 1), tags)
        self.mailbox.finish()
        recv_specs: dict[tuple, ActivationSpec] = {}
        for stage in placement.stages_of(self.rank):
            for mb in range(m):
                for c in range(k):
                    recv_specs[("F", stage - 1, mb, c)] = in_specs[stage][mb * k + c]
                    recv_specs[("B", stage + 1, mb, c)] = out_specs[stage][mb * k + c]
        sent = {(s, mb, c): out_specs[s][mb * k + c] for s in out_specs for mb in range(m) for c in range(k)}
        chunks = self._chunks(in_specs) if k > 1 else None
        return RankExecutor(self.program, self.rank, self.compute, self.mailbox, self.device, recv_specs, sent,
                            chunks=chunks, data_parallel=self.data_parallel)

    def _send_specs(self, stage: int, specs: list[ActivationSpec], peer: int, tags: Tags) -> None:
        """The input specs of `stage`, as two messages: the stream's length, then the stream
        (each flushed alone: NCCL then never holds the stream's send in one batch with the
        length's, whose receive the peer must complete before it can post the stream's)."""
        stream = encode_specs(specs).to(self.device)
        length = torch.tensor([stream.numel()], dtype=torch.int64, device=self.device)
        self.mailbox.send(length, peer, tags.shapes(stage, 0), f"the size of the shapes for stage {stage}")
        self.mailbox.flush()
        self.mailbox.send(stream, peer, tags.shapes(stage, 1), f"the shapes for stage {stage}")
        self.mailbox.flush()

    def _receive_specs(self, stage: int, peer: int, tags: Tags) -> list[ActivationSpec]:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        self.mailbox.recv(("shapes", stage, 0), length, peer, tags.shapes(stage, 0))
        size = int(self.mailbox.wait(("shapes", stage, 0), f"the shapes for stage {stage} from rank {peer}").item())
        stream = torch.empty(size, dtype=torch.int64, device=self.device)
        self.mailbox.recv(("shapes", stage, 1), stream, peer, tags.shapes(stage, 1))
        return decode_specs(self.mailbox.wait(("shapes", stage, 1), f"the shapes for stage {stage} from rank {peer}"))

    def _chunks(self, in_specs: dict[int, list[ActivationSpec]]) -> dict[tuple[int, int, int], SequenceChunk]:
        """Every unit's SequenceChunk, from the lengths of its stage input (dim 1 of its first leaf)."""
        k = self.schedule.seq_chunks
        out = {}
        for stage, specs in in_specs.items():
            for mb in range(self.schedule.m):
                units = [spec.leaves[0] for spec in specs[mb * k:(mb + 1) * k]]
                if any(len(spec.shape) < 2 for spec in units):
                    raise SpecMismatchError(
                        f"stage {stage} takes {units[0]} for microbatch {mb}; with sequence chunks stage inputs must "
                        "be [batch, tokens, ...], cut along dim 1"
                    )
                lengths = [spec.shape[1] for spec in units]
                for c, (offset, n) in enumerate(chunk_bounds(lengths)):
                    out[(stage, mb, c)] = SequenceChunk(stage, mb, c, k, offset, n, sum(lengths))
        return out

    def _infer(self, stage: int, specs: list[ActivationSpec], side: list[dict] | None) -> list[ActivationSpec]:
        if self.data_parallel is not None:
            self.data_parallel.before_compute(stage)  # a sharded chunk runs gathered (every replica alike)
        k = self.schedule.seq_chunks
        cache: dict[tuple, ActivationSpec] = {}
        out = []
        for unit, spec in enumerate(specs):
            mb = unit // k
            given = side[mb] if side else None
            key = (spec, tuple((name, TensorSpec.of(t)) for name, t in given.items()) if given else ())
            if key not in cache:
                try:
                    cache[key] = infer_output_spec(self.stages[stage], spec, self.device, given)
                except SpecMismatchError as err:
                    source = "the step inputs" if stage == 0 else f"the output of stage {stage - 1}"
                    with_side = f" with side inputs {_side_text([dict(key[1])])}" if given else ""
                    raise SpecMismatchError(
                        f"stage {stage} (rank {self.rank}) cannot take {source}, {spec} (microbatch {mb}){with_side}: "
                        f"{err}; make neighbouring stage modules agree on shape and dtype"
                    ) from err.__cause__
                except TypeError as err:
                    raise TypeError(f"stage {stage} (rank {self.rank}): {err}") from err
            out.append(cache[key])
        return out


def _lower(schedule: Schedule, dp: DataParallel | None, recompute: frozenset[tuple[int, int]]) -> Program:
    """The Program with the DP ops this rank's `dp` needs and the recomputations
    (`lowering.lower_for`), proved free of deadlock and well placed."""
    if dp is None:
        return lower_for(schedule, recompute=recompute, check=True)
    return lower_for(schedule, policies=dp.policies, dp=dp.d, recompute=recompute, reduce_at_end=dp.reduce_at_end,
                     units=dp.units, check=True)


def _even(seq: int, k: int) -> tuple[int, ...]:
    base, extra = divmod(seq, k)
    return tuple(base + (1 if i < extra else 0) for i in range(k))


def _check_seq_lengths(schedule: Schedule, lengths: Sequence[int] | None) -> tuple[int, ...] | None:
    k = schedule.seq_chunks
    if lengths is None:
        return None
    lengths = tuple(lengths)
    if k == 1:
        raise ValueError(
            f"seq_lengths {list(lengths)} given, but schedule {schedule.name!r} has no sequence chunks: drop "
            "seq_lengths or use a sequence-chunk schedule (seq1f1b, split_sequence(...))"
        )
    if len(lengths) != k or any(not isinstance(n, int) or isinstance(n, bool) for n in lengths):
        raise ValueError(
            f"seq_lengths {list(lengths)} must be {k} integers, one per sequence chunk of schedule {schedule.name!r}"
        )
    if min(lengths) < 1:
        raise ValueError(
            f"seq_lengths {list(lengths)} leave an empty chunk: every one of the {k} chunks needs at least one "
            "token; use fewer chunks or move tokens into the empty one"
        )
    return lengths


def _check_chunk_support(schedule: Schedule, stages: Mapping[int, torch.nn.Module], compute: object | None) -> None:
    """Every stage must take `chunk=` (attend over earlier chunks' K/V); checked before any step."""
    for stage, module in sorted(stages.items()):
        if not getattr(module, "supports_sequence_chunks", True):
            raise ValueError(
                f"schedule {schedule.name!r} cuts sequences into {schedule.seq_chunks} chunks, but stage {stage} "
                f"({type(module).__name__}) says it cannot run sequence chunks (supports_sequence_chunks is False): "
                "use a schedule without sequence chunks (drop --seq-chunks)"
            )
        if not _takes_chunk(module.forward):
            raise ValueError(
                f"schedule {schedule.name!r} cuts sequences into {schedule.seq_chunks} chunks, but stage {stage} "
                f"({type(module).__name__}) cannot take sequence chunks: its forward has no `chunk` keyword. A "
                "stage run by chunks must attend over the K/V of earlier chunks (causal attention with "
                "`chunk.kv(layer).extend(k, v)`, as pipeblocks.models.GPTStage does); use such a model or a "
                "schedule without sequence chunks"
            )
    if compute is not None and not _takes_chunk(compute.forward):
        raise ValueError(
            f"schedule {schedule.name!r} cuts sequences into {schedule.seq_chunks} chunks, but the compute object "
            f"{type(compute).__name__} takes no `chunk`: run it with real modules or a schedule without sequence chunks"
        )


def _takes_chunk(fn) -> bool:
    try:
        return "chunk" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _module_device(stages: Mapping[int, torch.nn.Module]) -> torch.device:
    for module in stages.values():
        for tensor in module.parameters():
            return tensor.device
    return torch.device("cpu")


def _microbatches(value, m: int, name: str) -> list:
    """m microbatches: of a tensor or a dict of tensors (split along dim 0), or as given (a
    list or tuple of m)."""
    if value is None:
        raise ValueError(f"{name} are required on this rank: it holds the stage that consumes them")
    if isinstance(value, (torch.Tensor, Mapping)):
        layout, leaves = flatten(value, name)
        for leaf in leaves:
            if leaf.dim() == 0 or leaf.shape[0] % m:
                raise ValueError(
                    f"{name} has leading dimension {leaf.shape[0] if leaf.dim() else 0}, not divisible by m={m}: "
                    f"give a batch size that is a multiple of {m}, or a list of {m} microbatches"
                )
        # clones: each microbatch owns its storage, so what autograd saves of it is freed with it
        parts = [[part.clone() for part in leaf.chunk(m)] for leaf in leaves]
        return [layout.build([p[i] for p in parts]) for i in range(m)]
    value = list(value)
    if len(value) != m:
        raise ValueError(f"{name} has {len(value)} microbatches but the schedule has m={m}: give exactly {m}")
    return value


def _side_microbatches(side, m: int, device: torch.device) -> list[dict[str, torch.Tensor]] | None:
    """Per microbatch, name -> tensor (on `device`); None without side inputs."""
    if not side:
        return None
    if not isinstance(side, Mapping):
        raise TypeError(f"side_inputs must be a dict name -> tensor, got {type(side).__name__}")
    per_name = {}
    for name, value in side.items():
        if not isinstance(name, str) or name == "chunk":
            raise ValueError(f"side input name {name!r}: names are str keywords of the stages' forward, not 'chunk'")
        parts = _microbatches(value, m, f"side input {name!r}")
        bad = [type(t).__name__ for t in parts if not isinstance(t, torch.Tensor)]
        if bad:
            raise TypeError(f"side input {name!r} has a microbatch of type {bad[0]}: give tensors")
        per_name[name] = [t.to(device) for t in parts]
    return [{name: parts[i] for name, parts in per_name.items()} for i in range(m)]


def _side_text(specs: list[dict[str, TensorSpec]]) -> str:
    if not specs:
        return "(none)"
    return str([{name: str(spec) for name, spec in mb.items()} for mb in specs])


def _to(value, device: torch.device):
    """An input or target (a tensor, or a tuple or dict of tensors) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    layout, leaves = flatten(value, "an input")
    return layout.build([t.to(device) for t in leaves])
