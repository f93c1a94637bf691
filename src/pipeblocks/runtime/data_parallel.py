"""Data parallelism of one pipeline rank's chunks: the sharding policies on torch's own
machinery, the DP ops of the Program, the optimizer, and the static bytes held.

    dp = DataParallel(stages, policies, mesh)            # before building the optimizer
    optimizer = dp.optimizer(torch.optim.AdamW, lr=3e-3)
    runner = PipelineRunner(schedule, stages, loss_fn, group=mesh.pp_group, data_parallel=dp)
    runner.step(x, y); optimizer.step(); dp.sample_static(); optimizer.zero_grad()

The parts live beside this module, which re-exports their public names: a chunk's sharding
and state (`dp_chunks`), when DP communication overlaps the passes and the log of it
(`dp_overlap`, `DPEvent`), one optimizer per chunk (`chunk_optimizers`, `ChunkOptimizers`),
the link and static-byte measurements (`dp_measure`, `measure_link`, `held_bytes`), and the
units' FSDP2 groups, gradient buckets and readiness hooks (`dp_units`).

What each policy is built on (torch 2.13), per chunk (global stage):

    replicate  plain module; REDUCE_GRAD launches an asynchronous all-reduce (sum) of every
               gradient on the dp group (what DDP does, one bucket per tensor); the end of
               the step waits for it and divides by d
    zero1      as replicate, with torch's ZeroRedundancyOptimizer over the dp group: each
               replica keeps AdamW state for its partition of the chunk's parameters
               (whole tensors, greedily balanced by size) and broadcasts what it updated
    zero2      FSDP2 `fully_shard(module, mesh=dp, reshard_after_forward=False)`: parameters
               are gathered at the chunk's first pass of the step and stay gathered until
               REDUCE_GRAD, which reduce-scatters the accumulated gradients and frees them
    zero3      the same FSDP2 module, gathered by the Program's UNSHARD (asynchronously,
               waited by the chunk's first pass) and freed by its RESHARD

Units (`units=`, `core.ir.dp_units`; block grain): a chunk of several units is sharded per
unit (`dp_units.shard_units`: `fully_shard` per unit, the stage as root) and its DP ops name
a unit: `2UNSHARD.1` gathers unit 1 (asynchronously, waited by the chunk's first pass),
`2REDUCE_GRAD.1` stands for unit 1's reduction, `2RESHARD.1` frees it. A unit's reduction
is a reduce-scatter of its gradients under FSDP2 (its group's post-backward with sync on;
the chunk's last REDUCE_GRAD also runs FSDP2's final callback) and one flat all-reduce
bucket under replicate and zero1 (`dp_units.GradBucket`, waited at the end of the step).
Chunk grain keeps one all-reduce per gradient tensor, as before.

A unit's reduction is launched inside its stage's last weight-gradient pass as the unit's
gradients complete, and the gathers that open the next step are issued right after the
chunk's optimizer step (`gather_ahead`): `dp_overlap`. Gradient sync stays off for every
microbatch until REDUCE_GRAD: `dp_chunks`.

Static bytes (`sample_static`, `peak_static`): what each policy holds at the peak, and where
the peak is sampled, in `dp_measure`.

On CPU (gloo) FSDP2's reduce-scatter and all-gather complete inside the call that issues
them; on GPU they run on FSDP's communication streams.
"""
from __future__ import annotations

import datetime
import time
from collections import deque
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..core.ir.actions import Action
from ..core.ir.dp_units import DPUnits
from ..core.ir.ops import DPOp, Op, Recompute
from ..core.ir.sharding import FSDP_POLICIES as _FSDP, ShardingPolicy
from .chunk_optimizers import ChunkOptimizers
from .comm import PeerTimeoutError
from .dp_chunks import ChunkState, UnitState, reduce_scatter_chunk, shard_chunk
from .dp_measure import chunk_static_tensors, held_bytes, measure_link
from .dp_overlap import DPEvent, GathersAhead, InPassReductions
from .dp_units import GradBucket, finish_reduce_scatter, reduce_scatter_unit
from .emulated_link import EmulatedLink
from ..core.cost.static_memory import zero1_partition

__all__ = ["DataParallel", "ChunkOptimizers", "DPEvent", "held_bytes", "measure_link", "zero1_partition"]




class DataParallel:
    """This rank's chunks on the dp group of the mesh; runs the Program's DP ops.

    stages: global stage -> module (this rank's). policies: one per global stage
    (`core.ir.sharding.per_stage`). dp_mesh: the mesh's "dp" DeviceMesh; dp_group its group.
    Build it before the optimizer: FSDP2 replaces the parameters by their shards.
    link: an `emulated_link.EmulatedLink` under emulated compute (any policy): each DP op
    also takes its modelled link time, waited where the real one is (a zero3 chunk's first
    pass after its UNSHARD, the end of the step). reduce_at_end: lower every REDUCE_GRAD to the
    end of the rank's step instead of right after its stage's last weight gradient.
    units: the DP units of every global stage (`core.ir.dp_units.DPUnits`; None: chunk grain);
    a stage of several units must be a `models.Stage` with that many blocks.
    gather_ahead: issue the gathers that open the next step (its leading UNSHARD ops) as
    soon as the chunk's optimizer step is done (`ChunkOptimizers.step`); the next step's
    UNSHARD finds them in flight. The parameters stay sharded until the step's first pass
    waits (module doc); `drop_gathers_ahead` cancels them.
    """

    def __init__(
        self,
        stages: Mapping[int, torch.nn.Module],
        policies: Sequence[ShardingPolicy],
        dp_mesh,
        *,
        timeout_s: float = 300.0,
        link: EmulatedLink | None = None,
        reduce_at_end: bool = False,
        mp_policy=None,
        extra_static: Callable[[], Iterable[torch.Tensor]] | None = None,
        units: DPUnits | None = None,
        gather_ahead: bool = True,
    ) -> None:
        self.dp_mesh = dp_mesh
        self.group = dp_mesh.get_group()
        self.d = dist.get_world_size(self.group)
        self.timeout_s = float(timeout_s)
        self.link = link
        self.reduce_at_end = bool(reduce_at_end)  # the no-overlap baseline: every REDUCE_GRAD at the end
        self.units = units
        if units is not None:
            units.check_stages(len(policies))
        self.events: deque[DPEvent] = deque(maxlen=4096)  # what launched when (DPEvent); the latest kept
        self._in_pass = InPassReductions(self._launch, self.events)
        self.chunks: dict[int, ChunkState] = {}
        for stage, module in sorted(stages.items()):
            if not 0 <= stage < len(policies):
                raise ValueError(f"stage {stage} has no sharding policy: give one policy per stage ({len(policies)})")
            sizes = units.sizes[stage] if units is not None and units.count(stage) > 1 else None
            chunk = shard_chunk(stage, module, ShardingPolicy(policies[stage]), dp_mesh, unit_sizes=sizes,
                                mp_policy=mp_policy)
            if chunk.units is not None:
                chunk.readiness = self._in_pass.readiness(chunk)
            self.chunks[stage] = chunk
        self.policies = tuple(ShardingPolicy(p) for p in policies)
        self.extra_static = extra_static  # tensors held beside the chunks' (the compute copies of bf16-mixed)
        self._compute = None  # set by the runner: its compute object learns the gathered parameters
        self.tracker = None  # set by the runner: gathered parameters are not activations
        self.optimizers: ChunkOptimizers | None = None
        self.wait_s = 0.0
        self.peak_static = 0
        self._compute_end = 0.0  # when the rank's last pass ended (perf_counter)
        self.gather_ahead = bool(gather_ahead)
        self._ahead = GathersAhead(self.chunks, self.events)

    def use_program(self, ops: Sequence[Op]) -> None:
        """The rank's ops of the Program the runner runs (the runner calls this): each stage's
        REDUCE_GRADs that directly follow a weight-gradient pass of the stage (only sends and
        DP ops between) are launched inside that pass, unit by unit, at block grain; the
        UNSHARDs before the rank's first other op are the gathers issued ahead."""
        self._in_pass.plan(ops, self.chunks)
        self._ahead.plan(ops)

    @property
    def compute(self):
        """The runner's compute object (set by the runner): it learns the gathered parameters,
        and emulated compute at block grain times its passes on the emulated link."""
        return self._compute

    @compute.setter
    def compute(self, compute) -> None:
        self._compute = compute
        if self.link is not None and self.link.units is not None and hasattr(compute, "pass_timer"):
            compute.pass_timer = self.link.run_pass

    # ---- the optimizer ---------------------------------------------------------------
    def optimizer(self, optimizer_class: Callable[..., torch.optim.Optimizer], **defaults) -> ChunkOptimizers:
        """One optimizer per chunk: `optimizer_class` over its (sharded) parameters, or under
        ZeroRedundancyOptimizer on the dp group for zero1 chunks. Its `step` issues the next
        step's first gathers of each zero3 chunk once that chunk has stepped (`gather_ahead`)."""
        self.optimizers = ChunkOptimizers.for_chunks(self.chunks, optimizer_class, self.group,
                                                     self._after_optimizer_step, **defaults)
        return self.optimizers

    # ---- the DP ops --------------------------------------------------------------------
    def run(self, op: DPOp) -> None:
        """Run one DP op of the Program (on the communication side: it does not wait)."""
        chunk = self.chunks.get(op.stage)
        if chunk is None:
            raise ValueError(f"{op}: stage {op.stage} is not on this rank (stages {sorted(self.chunks)})")
        unit = self._unit(chunk, op)
        if op.kind == "UNSHARD":
            self._unshard(chunk) if unit is None else self._unshard_unit(chunk, unit)
        elif op.kind == "RESHARD":
            self.sample_static()
            self._reshard(chunk) if unit is None else self._reshard_unit(chunk, unit)
        elif op.kind == "REDUCE_GRAD":
            self.sample_static()
            self._reduce(chunk) if unit is None else self._reduce_unit(chunk, unit)
        else:
            raise ValueError(f"the runtime does not run DP op kind {op.kind!r} ({op})")
        if self.link is not None:
            self.link.issue(op.kind, op.stage, op.unit)

    def before_compute(self, stage: int, action: Action | Recompute | None = None) -> None:
        """Called before every pass of `stage` (`action`, as the executor runs it): the
        parameters must be gathered (zero3 waits for its UNSHARDs; zero2 gathers at its
        first pass of the step); the stage's last weight-gradient pass launches each unit's
        reduction as the unit's gradients complete."""
        chunk = self.chunks[stage]
        self._gather(chunk)
        self._in_pass.before_pass(chunk, action)

    def _gather(self, chunk: ChunkState) -> None:
        stage = chunk.stage
        if chunk.gathered or chunk.policy not in _FSDP:
            return
        start = time.perf_counter()
        if chunk.units is not None:
            for unit in chunk.units:  # in block order: the order the forward needs them
                if unit.handle is not None:
                    handle, unit.handle, unit.ahead = unit.handle, None, False
                    handle.wait()
                elif not unit.gathered:
                    unit.fsdp.unshard()
                unit.gathered = True
            chunk.module.unshard()  # the root's own parameters, if it holds any
        elif chunk.unshard_handle is None:
            chunk.module.unshard()
        else:
            handle, chunk.unshard_handle, chunk.ahead = chunk.unshard_handle, None, False
            handle.wait()
        if self.link is not None:
            # the modelled gather issued at the UNSHARD is the one counted; zero2's gather
            # here is modelled after the optimizer step (`EmulatedLink.finish`)
            start = time.perf_counter()
            if chunk.units is None:
                self.link.wait_stage(stage)
        self.wait_s += time.perf_counter() - start
        chunk.gathered = True
        self._show_parameters(chunk)

    def after_compute(self) -> None:
        """Called after every pass: the end of the step's exposed communication is counted
        from the last one under an emulated link; a pass that launched reductions ends them."""
        self._compute_end = time.perf_counter()
        self._in_pass.after_pass(self._compute_end)

    def _launch(self, chunk: ChunkState, unit: UnitState) -> None:
        """A unit's gradients are complete inside its stage's last weight-gradient pass:
        launch its reduction now (the REDUCE_GRAD op that follows finds it in flight). The
        static bytes are sampled first, where the REDUCE_GRAD would sample them."""
        self.sample_static()
        unit.launched = True
        self.events.append(DPEvent("reduce_in_pass", chunk.stage, unit.index, time.perf_counter()))
        self._start_reduction(chunk, unit)

    def _start_reduction(self, chunk: ChunkState, unit: UnitState) -> None:
        """A unit's reduce-scatter (FSDP2: its group's post-backward with sync on, the
        parameters kept gathered) or its bucket's all-reduce."""
        if chunk.policy in _FSDP:
            start = time.perf_counter()
            reduce_scatter_unit(unit.fsdp, reshard=False)
            if self.link is None:  # under a link its modelled reduce-scatter is the one counted
                self.wait_s += time.perf_counter() - start
            return
        chunk.buckets.append(GradBucket([p.grad for p in unit.params], self.group))

    def finish(self) -> None:
        """The end of the step: wait for every reduction (the optimizer needs them). Under an
        emulated link the time from the rank's last pass to here counts too (the real DP ops
        run there, in the modelled collectives' shadow), once."""
        start = time.perf_counter() if self.link is None else min(self._compute_end or time.perf_counter(),
                                                                 time.perf_counter())
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for chunk in self.chunks.values():
            try:
                for work, grad in chunk.reductions:
                    work.wait(timeout)
                    grad.div_(self.d)
                for bucket in chunk.buckets:
                    bucket.wait(timeout, self.d)
            except RuntimeError as err:
                if "imeout" in str(err) or "imed out" in str(err):
                    raise PeerTimeoutError(
                        f"stage {chunk.stage}: the gradient all-reduce over the {self.d} replicas did not finish "
                        f"within {self.timeout_s:g} s: a replica failed or hangs"
                    ) from None
                raise
            chunk.reductions = []
            chunk.buckets = []
            if self.link is not None:
                self.link.wait_stage(chunk.stage)
            chunk.reducing = False
            for unit in chunk.units or ():
                unit.reduced = False
                if unit.handle is not None:
                    raise RuntimeError(f"stage {chunk.stage}: the step ended with {chunk.stage}UNSHARD.{unit.index} "
                                       "never used; add its passes")
            if chunk.unshard_handle is not None:
                raise RuntimeError(f"stage {chunk.stage}: the step ended with an UNSHARD never used; add its passes")
            if chunk.gathered and chunk.policy in _FSDP:
                raise RuntimeError(f"stage {chunk.stage}: the step ended with its parameters gathered; RESHARD it")
        if self.link is not None:
            self.wait_s += self.link.take_pass_waits()
            self.link.finish(sorted(self.chunks))
        self.wait_s += time.perf_counter() - start

    def after_shape_pass(self) -> None:
        """The shape pass may have run (and so gathered) a chunk's forward: free it again, so
        that every step starts with sharded parameters."""
        for chunk in self.chunks.values():
            if chunk.policy in _FSDP:
                for unit in chunk.units or ():
                    unit.fsdp.reshard()
                    unit.gathered = False
                chunk.module.reshard()
                chunk.gathered = False

    def reset_step(self) -> None:
        self.wait_s = 0.0
        self.peak_static = 0
        self._in_pass.disarm()  # a step that failed inside the pass
        self.events.append(DPEvent("step_start", -1, None, time.perf_counter()))

    # ---- the next step's first gathers -------------------------------------------------
    def _after_optimizer_step(self, stage: int) -> None:
        """`stage`'s optimizer has stepped: issue the gathers that open the next step for it
        (`dp_overlap.GathersAhead.issue`)."""
        if self.gather_ahead:
            self._ahead.issue(stage)

    def drop_gathers_ahead(self) -> None:
        """Wait for the gathers issued ahead and free them again (after the last step, or
        before the parameters change outside an optimizer step, e.g. a checkpoint load
        between steps: a gather in flight holds the values of when it was issued)."""
        self._ahead.drop()

    # ---- static bytes ------------------------------------------------------------------
    def static_tensors(self) -> list[torch.Tensor]:
        tensors = chunk_static_tensors(self.chunks.values())
        if self.extra_static is not None:
            tensors.extend(self.extra_static())
        if self.optimizers is not None:
            tensors.extend(self.optimizers.state_tensors())
        return tensors

    def sample_static(self) -> int:
        """Static bytes now; the step's peak keeps the largest sample."""
        now = held_bytes(self.static_tensors())
        self.peak_static = max(self.peak_static, now)
        return now

    # ---- internals ---------------------------------------------------------------------
    def _unit(self, chunk: ChunkState, op: DPOp) -> UnitState | None:
        if op.unit is None:
            if chunk.units is not None:
                raise ValueError(f"{op}: stage {op.stage} has {len(chunk.units)} DP units here; its ops must name one "
                                 "(lower the Program with the same units as the DataParallel)")
            return None
        if chunk.units is None or not 0 <= op.unit < len(chunk.units):
            count = 1 if chunk.units is None else len(chunk.units)
            raise ValueError(f"{op}: stage {op.stage} has {count} DP unit(s) here (DataParallel(units=...)); "
                             "lower the Program with the same units")
        return chunk.units[op.unit]

    def _unshard(self, chunk: ChunkState) -> None:
        if chunk.policy not in _FSDP:
            raise ValueError(
                f"{chunk.stage}UNSHARD: stage {chunk.stage} is {chunk.policy}, its parameters are not sharded; "
                "UNSHARD is for zero3 chunks"
            )
        if chunk.ahead:  # issued after the optimizer step
            chunk.ahead = False
            self.events.append(DPEvent("unshard_found_ahead", chunk.stage, None, time.perf_counter()))
            return
        if chunk.gathered or chunk.unshard_handle is not None:
            raise RuntimeError(f"{chunk.stage}UNSHARD: stage {chunk.stage} is already gathered")
        chunk.unshard_handle = chunk.module.unshard(async_op=True)

    def _unshard_unit(self, chunk: ChunkState, unit: UnitState) -> None:
        name = f"{chunk.stage}UNSHARD.{unit.index}"
        if chunk.policy not in _FSDP:
            raise ValueError(f"{name}: stage {chunk.stage} is {chunk.policy}, its parameters are not sharded; "
                             "UNSHARD is for zero3 chunks")
        if unit.ahead:  # issued after the optimizer step
            unit.ahead = False
            self.events.append(DPEvent("unshard_found_ahead", chunk.stage, unit.index, time.perf_counter()))
            return
        if unit.gathered or unit.handle is not None:
            raise RuntimeError(f"{name}: unit {unit.index} of stage {chunk.stage} is already gathered")
        unit.handle = unit.fsdp.unshard(async_op=True)

    def _reshard(self, chunk: ChunkState) -> None:
        if chunk.unshard_handle is not None:
            raise RuntimeError(f"{chunk.stage}RESHARD: its UNSHARD is still pending (no pass of the stage ran)")
        if chunk.policy in _FSDP and chunk.gathered:
            chunk.module.reshard()
            chunk.gathered = False

    def _reshard_unit(self, chunk: ChunkState, unit: UnitState) -> None:
        if unit.handle is not None:
            raise RuntimeError(f"{chunk.stage}RESHARD.{unit.index}: its UNSHARD is still pending (no pass of the "
                               "stage ran)")
        if chunk.policy in _FSDP and unit.gathered:
            unit.fsdp.reshard()
            unit.gathered = False
            if not any(u.gathered for u in chunk.units):
                chunk.module.reshard()
                chunk.gathered = False

    def _reduce(self, chunk: ChunkState) -> None:
        if chunk.reducing:
            raise RuntimeError(f"{chunk.stage}REDUCE_GRAD: stage {chunk.stage} reduced twice in one step")
        chunk.reducing = True
        if chunk.policy in _FSDP:
            start = time.perf_counter()
            reduce_scatter_chunk(chunk.module, reshard=chunk.policy is ShardingPolicy.ZERO2)
            if self.link is None:  # under a link its modelled reduce-scatter is the one counted
                self.wait_s += time.perf_counter() - start
            if chunk.policy is ShardingPolicy.ZERO2:
                chunk.gathered = False
            return
        for param in chunk.own_params:
            if param.grad is not None:
                work = dist.all_reduce(param.grad, group=self.group, async_op=True)
                chunk.reductions.append((work, param.grad))

    def _reduce_unit(self, chunk: ChunkState, unit: UnitState) -> None:
        if unit.reduced:
            raise RuntimeError(f"{chunk.stage}REDUCE_GRAD.{unit.index}: unit {unit.index} of stage {chunk.stage} "
                               "reduced twice in one step")
        unit.reduced = True
        last = all(u.reduced for u in chunk.units)
        if not unit.launched:  # no pass launched it (its gradients never completed inside one)
            self.events.append(DPEvent("reduce_at_op", chunk.stage, unit.index, time.perf_counter()))
            self._start_reduction(chunk, unit)
        unit.launched = False
        if chunk.policy in _FSDP:
            zero2 = chunk.policy is ShardingPolicy.ZERO2
            start = time.perf_counter()
            if zero2:  # zero2 frees the gathered parameters at REDUCE_GRAD, wherever it launched
                unit.fsdp.reshard()
                unit.gathered = False
            if last:
                finish_reduce_scatter(chunk.module, reshard=zero2)
                chunk.reducing = True
                if zero2:
                    chunk.gathered = False
            if self.link is None:
                self.wait_s += time.perf_counter() - start
            return
        if last:  # parameters no unit holds (parts shared by every stage) go in a bucket of their own
            held = {id(p) for u in chunk.units for p in u.params}
            rest = [p.grad for p in chunk.own_params if id(p) not in held]
            if any(g is not None for g in rest):
                chunk.buckets.append(GradBucket(rest, self.group))
        chunk.reducing = chunk.reducing or last

    def _show_parameters(self, chunk: ChunkState) -> None:
        params = list(chunk.module.parameters())
        if self.compute is not None:
            self.compute.use_parameters(chunk.stage, [p for p in params if p.requires_grad])
        if self.tracker is not None:
            self.tracker.also_exclude(params)
