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
calls each stage with `chunk=` (see the package docstring, sequence_cut.py and sequence.py).

One `step` runs the whole lowered Program of this rank once: the m forwards and backwards,
with parameter gradients accumulated into `.grad` (they are not zeroed: call
`optimizer.zero_grad()` yourself, or pass `optimizer=` to have the runner step and zero
after each flush). The loss is the mean over the m microbatch losses, so with equal
microbatches the gradients equal one process training the whole batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..core.ir.actions import Action
from ..core.lowering.entry import lower_for
from ..core.ir.ops import DPOp, Recompute
from ..core.ir.program import Program
from ..core.ir.vocab import VocabPass
from ..core.lowering.passes_dp import check_dp_ops, needs_dp_ops
from ..core.lowering.recompute import recompute_pairs
from ..core.ir.schedule import Schedule
from ..core.simulator.simulate import simulate_program
from ..core.simulator.timeline import Timeline
from .comm import Mailbox, Tags
from .compute import ModuleCompute
from .copies import StageCopies
from .executor import RankExecutor
from .memory import SavedTensorTracker
from .sequence_cut import check_chunk_support, check_seq_lengths, check_target_chunks, cut_sequences, sequence_chunks
from .shapes import ActivationSpec, SpecMismatchError, TensorSpec, decode_specs, encode_specs, infer_output_spec
from .step_inputs import microbatches, side_microbatches, side_text, to_device
from .timeline import gather_timeline

if TYPE_CHECKING:
    from ..core.cost.costs import Costs
    from .data_parallel import DataParallel
    from .vocab_step import VocabStep
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
        just before the pair's backward (`core.lowering.recompute.add_recompute` places the RECOMPUTE
        ops); the gradients are those without recomputation. None or none given: every pair
        when the schedule's options say recompute="all" (`1f1b-r`), else none
        (`core.lowering.recompute.recompute_pairs`). Not with sequence chunks (ValueError).
    recompute_at: where a unit's RECOMPUTE runs when the simulator moved it into idle time
        (`resolve.recompute_place`): the compute action it precedes; the others run just
        before their backward. The Program is then the one the simulator ran.
    program: a lowered Program of `schedule` to run instead of `core.lowering.entry.lower_for`'s:
        the one `pipeblocks train` resolved for the run (`resolve.program.Lowering`), checked
        against `data_parallel`, `recompute` and `vocab` when they are given too; or an
        asynchronous one (`pipeblocks.schedules.asynchronous`) whose OPTIMIZER_STEP ops go to
        `compute.optimizer_step(stage, step)`; then one `step` call runs the whole Program
        (all its optimizer steps, one flush at the end).
    precision: a `precision.ComputeCopies` whose `stages` (the `CastStage`s) are among
        `stages`: every step casts their parameters once (`begin_step`) before the first
        pass and drops the copies (`end_step`) when the step's work is done, before the
        optimizer may step; the copies are not counted as activations. Chunks sharded by
        FSDP2 cast through FSDP2's own MixedPrecisionPolicy instead.
    vocab: vocabulary parallelism (`vocab_step.VocabStep`, this rank's table shards and
        their link): stage 0 holds no embedding and the last stage no head (it ends at the
        final norm's output X; `loss_fn` is not called); `vocab_costs`, costs whose `vocab`
        is set, place the IF, S, T and IB passes into the Program (`core.lowering.vocab_place`).
        Every rank then takes the step's inputs and targets, and knows its loss. With
        `data_parallel` the rows' gradients are averaged over the replicas after the step.
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
        recompute_at: Mapping[tuple[int, int, int], Action] | None = None,
        program: Program | None = None,
        precision: ComputeCopies | None = None,
        vocab: VocabStep | None = None,
        vocab_costs: Costs | None = None,
    ) -> None:
        _check_group(schedule, group)
        self.seq_lengths = check_seq_lengths(schedule, seq_lengths)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.schedule = schedule
        self.data_parallel = data_parallel
        self.precision = precision
        self.vocab = vocab
        self.recompute = recompute_pairs(schedule, recompute) if program is None or recompute else frozenset()
        if self.recompute and schedule.seq_chunks > 1:
            raise ValueError(
                f"schedule {schedule.name!r} cuts sequences into {schedule.seq_chunks} chunks: the runtime does not "
                "recompute sequence chunks (a chunk's recomputation would append its K/V twice); drop the "
                "recomputation (--recompute none, or a schedule without -r) or the sequence chunks"
            )
        if program is None:
            if vocab is not None and (vocab_costs is None or vocab_costs.vocab is None):
                raise ValueError("vocab= needs vocab_costs= (Costs whose vocab is set) to place the vocabulary "
                                 "passes, or program= lowered with them")
            program = _lower(schedule, data_parallel, self.recompute, recompute_at,
                             vocab_costs if vocab is not None else None)
        elif recompute_at or vocab_costs is not None:
            raise ValueError("program= with recompute_at= or vocab_costs=: where recomputations and vocabulary passes "
                             "run is the lowering's; lower them into the program, or give no program=")
        else:
            _check_program(program, schedule, data_parallel, self.recompute if recompute else None, vocab)
        self.program = program
        self.rank = _check_rank(rank, group)
        mine = schedule.placement.stages_of(self.rank)
        if sorted(stages) != list(mine):
            raise ValueError(
                f"rank {self.rank} holds stages {list(mine)} of schedule {schedule.name!r} "
                f"(placement {schedule.placement.shape}), but stages {sorted(stages)} were given"
            )
        self.stages = dict(stages)
        if schedule.seq_chunks > 1:
            check_chunk_support(schedule, self.stages, compute)
        self.loss_fn = loss_fn
        self.group = group
        self.device = torch.device(device) if device is not None else _module_device(self.stages)
        self.timeout_s = float(timeout_s)
        self.optimizer = optimizer
        self.record_timeline = record_timeline
        self.tracker = SavedTensorTracker(enabled=measure_memory)
        self.compute = compute if compute is not None else self._module_compute(loss_fn)
        # DualPipe: the copies of a model stage (one per chain) sum their gradients each step
        self.copies = StageCopies.of(schedule, self.stages, group, data_parallel, self.timeout_s)
        self.mailbox = Mailbox(group, self.timeout_s, self.rank)
        if data_parallel is not None:
            self._attach_data_parallel(data_parallel, emulated=compute is not None)
        self._executor: RankExecutor | None = None
        self._input_specs: list[ActivationSpec] | None = None
        self._side_specs: list[dict[str, TensorSpec]] | None = None

    def _module_compute(self, loss_fn) -> ModuleCompute:
        """The stage modules' own compute (the loss on every chain's last stage, none under vocab=)."""
        schedule, vocab = self.schedule, self.vocab
        return ModuleCompute(
            self.stages, loss_fn, schedule.num_stages - 1, schedule.m, self.tracker,
            loss_stages=frozenset() if vocab is not None else frozenset(
                s for s in range(schedule.num_stages) if schedule.ends_chain(s)),
            first_takes_grad=vocab is not None,
        )

    def _attach_data_parallel(self, data_parallel: DataParallel, *, emulated: bool) -> None:
        if emulated and data_parallel.link is None:
            raise ValueError(
                "data_parallel with emulated compute needs an emulated link: give DataParallel(..., link="
                "EmulatedLink(...)), or drop compute="
            )
        data_parallel.compute = self.compute
        data_parallel.tracker = self.tracker
        data_parallel.use_program(self.program.ranks[self.rank])

    @property
    def measure_memory(self) -> bool:
        """Whether the next step counts saved-activation bytes (settable between steps)."""
        return self.tracker.enabled

    @measure_memory.setter
    def measure_memory(self, on: bool) -> None:
        self.tracker.enabled = bool(on)

    @property
    def holds_first_stage(self) -> bool:
        """This rank takes step inputs: it holds stage 0 (or, with chains, a chain's first)."""
        return any(self.schedule.starts_chain(s) for s in self.stages)

    @property
    def holds_last_stage(self) -> bool:
        """This rank computes losses: the last stage (or, with chains, a chain's last); with
        chains each such rank's `loss` sums its own microbatches' losses over m."""
        return any(self.schedule.ends_chain(s) for s in self.stages)

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
        xs, ys, side = self._step_inputs(inputs, targets, side_inputs)
        dp = self.data_parallel
        copies = self.precision.begin_step() if self.precision is not None else []
        if self._executor is None:
            self._executor = self._build_executor(xs, side)
            if dp is not None:
                dp.after_shape_pass()
            if ys is not None and self._executor.chunks is not None:
                check_target_chunks(ys, self._executor.chunks, self.schedule, self.rank)
        if self.tracker.enabled:
            self.tracker.exclude([*(p for mod in self.stages.values() for p in mod.parameters()),
                                  *(b for mod in self.stages.values() for b in mod.buffers())])
            self.tracker.also_exclude(copies)  # the weights' compute copies are not activations
        origin = time.perf_counter()
        self.tracker.reset_peak()
        if dp is not None:
            dp.reset_step()
        if self.vocab is not None:
            self.vocab.begin_step(xs, ys)
        record = self._executor.run(xs, ys, side)
        losses = self._end_step(record)
        duration = time.perf_counter() - origin
        self._check_kv_cache()
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
        return StepResult(
            loss=sum(losses) / m if self.holds_last_stage else None,
            losses=losses,
            peak_saved_bytes=self.tracker.peak if measured else None,
            wait_s=record.wait_s,
            duration_s=duration,
            timeline=timeline,
            memory_trace=trace,
        )

    def _step_inputs(self, inputs, targets, side_inputs) -> tuple[list | None, list | None, list[dict] | None]:
        """The step's microbatches (cut into sequence chunks) on this rank's device, checked
        against the first step's shapes."""
        m = self.schedule.m
        every = self.vocab is not None  # the vocabulary passes of every rank take both
        xs = microbatches(inputs, m, "inputs") if self.holds_first_stage or every else None
        ys = microbatches(targets, m, "targets") if self.holds_last_stage or every else None
        side = side_microbatches(side_inputs, m, self.device)
        side_specs = [{name: TensorSpec.of(t) for name, t in mb.items()} for mb in side] if side else []
        _check_fixed("side inputs", side_specs, self._side_specs, side_text)
        self._side_specs = side_specs
        if xs is not None:
            xs = cut_sequences([to_device(x, self.device) for x in xs], "inputs", self.schedule, self.seq_lengths)
            specs = [ActivationSpec.of(x, "the step inputs") for x in xs]
            _check_fixed("step inputs", specs, self._input_specs, lambda given: [str(s) for s in given])
            self._input_specs = specs
        if ys is not None:
            ys = cut_sequences([to_device(y, self.device) for y in ys], "targets", self.schedule, self.seq_lengths)
        return xs, ys, side

    def _end_step(self, record) -> tuple[float, ...]:
        """After the Program ran: the losses, every reduction done, the compute copies dropped,
        DualPipe's copies' gradients summed."""
        losses = self.vocab.end_step() if self.vocab is not None else record.losses
        dp = self.data_parallel
        if dp is not None:
            dp.finish()
            if self.vocab is not None:
                self.vocab.reduce_gradients(dp.group, dp.d)
        if self.precision is not None:
            self.precision.end_step()
        if self.copies is not None:
            self.copies.sum_gradients()
        return losses

    def _check_kv_cache(self) -> None:
        kv_cache = getattr(self.compute, "kv_cache", None)
        if kv_cache is not None and len(kv_cache):
            raise RuntimeError(
                f"rank {self.rank}: the step ended with K/V caches of (stage, microbatch) {kv_cache.in_flight()} "
                "still held: every chunk 0 must run its backward"
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
            if schedule.starts_chain(stage):
                specs = [ActivationSpec.of(self.vocab.stage_input(x) if self.vocab is not None else x) for x in xs]
            elif placement.rank_of(stage - 1) == self.rank:
                specs = out_specs[stage - 1]
            else:
                specs = self._receive_specs(stage, placement.rank_of(stage - 1), tags)
            in_specs[stage] = specs
            out_specs[stage] = self._infer(stage, specs, side)
            if not schedule.ends_chain(stage) and placement.rank_of(stage + 1) != self.rank:
                self._send_specs(stage + 1, out_specs[stage], placement.rank_of(stage + 1), tags)
        self.mailbox.finish()
        recv_specs: dict[tuple, ActivationSpec] = {}
        for stage in placement.stages_of(self.rank):
            for mb in range(m):
                for c in range(k):
                    recv_specs[("F", stage - 1, mb, c)] = in_specs[stage][mb * k + c]
                    recv_specs[("B", stage + 1, mb, c)] = out_specs[stage][mb * k + c]
        sent = {(s, mb, c): out_specs[s][mb * k + c] for s in out_specs for mb in range(m) for c in range(k)}
        chunks = sequence_chunks(in_specs, m, k) if k > 1 else None
        return RankExecutor(self.program, self.rank, self.compute, self.mailbox, self.device, recv_specs, sent,
                            chunks=chunks, data_parallel=self.data_parallel, vocab=self.vocab)

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
                    with_side = f" with side inputs {side_text([dict(key[1])])}" if given else ""
                    raise SpecMismatchError(
                        f"stage {stage} (rank {self.rank}) cannot take {source}, {spec} (microbatch {mb}){with_side}: "
                        f"{err}; make neighbouring stage modules agree on shape and dtype"
                    ) from err.__cause__
                except TypeError as err:
                    raise TypeError(f"stage {stage} (rank {self.rank}): {err}") from err
            out.append(cache[key])
        return out


def _check_group(schedule: Schedule, group: dist.ProcessGroup | None) -> int:
    """The group's size, which must be the schedule's p, in an initialized process group."""
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
    return world


def _check_rank(rank: int | None, group: dist.ProcessGroup | None) -> int:
    mine = dist.get_rank(group)
    if rank is not None and rank != mine:
        raise ValueError(f"rank={rank} but this process is rank {mine} of the group")
    return mine


def _check_program(program: Program, schedule: Schedule, dp: DataParallel | None,
                   pairs: frozenset[tuple[int, int]] | None, vocab: VocabStep | None) -> None:
    """A Program lowered elsewhere (`resolve.program.Lowering`, an asynchronous one) holds what
    was given beside it: the recomputed `pairs` (None: not given), the DP ops `dp` runs, the
    vocabulary passes."""
    if program.schedule is not schedule and vocab is None:  # the vocabulary passes may hold one more microbatch
        raise ValueError("program= must be lowered from the schedule given: pass program.schedule as schedule")
    ops = [op for rank_ops in program.ranks for op in rank_ops]
    if pairs is not None:
        held = frozenset(op.unit[:2] for op in ops if type(op) is Recompute)
        if held != pairs:
            raise ValueError(f"program= recomputes {sorted(held)} but recompute= gives {sorted(pairs)}: lower the "
                             "program with the same pairs, or give one of them")
    if dp is not None:
        if needs_dp_ops(dp.policies, dp.d) and not any(type(op) is DPOp for op in ops):
            raise ValueError(f"program= has no DP ops but data_parallel= runs {dp.d} replica(s) of "
                             f"{[str(p) for p in dp.policies]}: lower it with the mesh's sharding and replicas")
        check_dp_ops(program, dp.policies, dp.units)
    if vocab is not None and not any(type(op) is VocabPass for op in ops):
        raise ValueError("vocab= needs the vocabulary passes in program=: lower it with costs whose vocab is set")


def _lower(schedule: Schedule, dp: DataParallel | None, recompute: frozenset[tuple[int, int]],
           recompute_at: Mapping[tuple[int, int, int], Action] | None = None, vocab: Costs | None = None) -> Program:
    """The Program with the DP ops this rank's `dp` needs, the recomputations where they
    were placed and the vocabulary passes (`lowering.lower_for`), proved free of deadlock
    and well placed."""
    mesh = {} if dp is None else {"policies": dp.policies, "dp": dp.d, "reduce_at_end": dp.reduce_at_end,
                                   "units": dp.units}
    return lower_for(schedule, recompute=recompute, recompute_at=recompute_at, check=True, vocab=vocab,
                     simulate=simulate_program, **mesh)


def _check_fixed(what: str, specs: list, first: list | None, text) -> None:
    """The step's `specs` are the first step's (`text` writes them for the message)."""
    if first is not None and specs != first:
        raise SpecMismatchError(
            f"{what} have specs {text(specs)} but the first step had {text(first)}: shapes are fixed after the "
            "first step; pad the batch or build a new PipelineRunner"
        )


def _module_device(stages: Mapping[int, torch.nn.Module]) -> torch.device:
    for module in stages.values():
        for tensor in module.parameters():
            return tensor.device
    return torch.device("cpu")

