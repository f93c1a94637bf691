"""Data parallelism of one pipeline rank's chunks: the sharding policies on torch's own
machinery, the DP ops of the Program, the optimizer, and the static bytes held.

    dp = DataParallel(stages, policies, mesh)            # before building the optimizer
    optimizer = dp.optimizer(torch.optim.AdamW, lr=3e-3)
    runner = PipelineRunner(schedule, stages, loss_fn, group=mesh.pp_group, data_parallel=dp)
    runner.step(x, y); optimizer.step(); dp.sample_static(); optimizer.zero_grad()

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

Gradient sync, reshard-after-backward and last-backward are off for every microbatch, so
FSDP's own backward hooks only accumulate; the REDUCE_GRAD op turns them on and runs
FSDP's post-backward for the chunk (as torch.distributed.pipelining's `perform_reduce_grad`
does), once per chunk per step (at block grain, per unit inside the last pass: below).

Units (`units=`, `core.dp_units`; block grain): a chunk of several units is sharded per
unit (`dp_units.shard_units`: `fully_shard` per unit, the stage as root) and its DP ops name
a unit: `2UNSHARD.1` gathers unit 1 (asynchronously, waited by the chunk's first pass),
`2REDUCE_GRAD.1` stands for unit 1's reduction, `2RESHARD.1` frees it. A unit's reduction
is a reduce-scatter of its gradients under FSDP2 (its group's post-backward with sync on;
the chunk's last REDUCE_GRAD also runs FSDP2's final callback) and one flat all-reduce
bucket under replicate and zero1 (`dp_units.GradBucket`, waited at the end of the step).
Chunk grain keeps one all-reduce per gradient tensor, as before.

Where a unit's reduction is launched: inside its stage's last weight-gradient pass of the
step (the W or BW that the stage's REDUCE_GRADs follow in the Program, with only sends and
DP ops between), as soon as the pass has accumulated the unit's last gradient
(`dp_units.GradReadiness`, post-accumulate-grad hooks; the pass runs the blocks in reverse,
so the last unit's reduction runs while the pass computes the others, as FSDP2's per-block
reduce-scatters and DDP's buckets do). The REDUCE_GRAD op then finds it in flight and only
does what follows it (zero2 frees the unit's gathered parameters there; the chunk's last
REDUCE_GRAD runs FSDP2's final callback); a unit no pass completed (a stage whose
REDUCE_GRADs sit elsewhere, as under `reduce_at_end`, or a parameter that got no gradient)
is launched by its op, as before. The Program is unchanged.

The next step's first gathers (`gather_ahead`, on by default): the UNSHARDs that open the
rank's Program are issued again as soon as their chunk's optimizer step is done
(`ChunkOptimizers.step` calls back per chunk), not when the next step reaches them; the
next step's UNSHARD finds its gather in flight. FSDP2 registers the gathered parameters
only when the next step's first pass waits for them, so between steps the modules hold
their shards: a checkpoint (the state dict) or an evaluation sees sharded parameters, and
the static bytes sampled after the optimizer step leave out the gather's buffer, which the
prediction counts from the next step's UNSHARD (on an accelerator that buffer, the leading
units' gathered bytes, is held from the optimizer step on). After the last step the
gathers stay in flight unless `drop_gathers_ahead` frees them. `events` logs when each of
these happened (`DPEvent`).

Static bytes (`held_bytes`): parameters, gradients and optimizer state this process holds,
counted once per storage (sharded and gathered parameters both count as parameters). The
peak is sampled where it can occur: before each op that frees (REDUCE_GRAD, RESHARD), before
each reduction launched inside a pass, and after the optimizer step. What each policy holds at that peak, for a chunk of P parameter
bytes on d replicas (fp32 AdamW: gradient P, state 2P):

    replicate  P + P + 2P                                  (after the optimizer step)
    zero1      P + P + 2P_r     P_r: this replica's partition (after the optimizer step)
    zero2/3    P/d + P + P + 2P/d  sharded and gathered parameters, unreduced full
               gradients, sharded state (before REDUCE_GRAD)

The textbook ZeRO-2/ZeRO-3 figures (4P + 12P/d, 16P/d) hold between steps only: one
reduction per step means full-size gradients accumulate until REDUCE_GRAD, and FSDP2 keeps
parameters gathered from the first pass to the last (a gather per microbatch would cost d
times the traffic). Between steps FSDP2's zero2 holds parameters sharded, below ZeRO-2.
On CPU (gloo) FSDP2's reduce-scatter and all-gather complete inside the call that issues
them; on GPU they run on FSDP's communication streams.
"""
from __future__ import annotations

import datetime
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..core.actions import Action, Kind
from ..core.dp_units import DPUnits
from ..core.program import DPOp, Op, Recompute
from ..core.sharding import ShardingPolicy
from .comm import PeerTimeoutError
from .dp_units import (GradBucket, GradReadiness, accumulated_grads, finish_reduce_scatter, gathers_in_flight,
                       reduce_scatter_unit,
                       shard_units, unit_modules, unsharded_leaves)
from .emulated_link import EmulatedLink
from .static_memory import zero1_partition

__all__ = ["DataParallel", "ChunkOptimizers", "DPEvent", "held_bytes", "measure_link", "zero1_partition"]

_FSDP = (ShardingPolicy.ZERO2, ShardingPolicy.ZERO3, ShardingPolicy.ZERO3_REGATHER)


def measure_link(group: dist.ProcessGroup, *, large_bytes: int = 1 << 21, repeats: int = 5) -> tuple[float, float]:
    """(bandwidth in bytes/s, latency per ring step in s) of the dp group, fitted to the ring
    all-reduce model 2(d-1)/d * n/bw + 2(d-1)*a from the median time of a one-element and a
    `large_bytes` all-reduce (a collective: every replica calls it)."""
    d = dist.get_world_size(group)
    if d == 1:
        return float("inf"), 0.0

    def timed(numel: int) -> float:
        tensor = torch.zeros(numel, dtype=torch.float64)
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    small, large = timed(1), timed(max(2, large_bytes // 8))
    latency = small / (2 * (d - 1))
    moved = 2 * (d - 1) / d * (large_bytes - 8)
    bandwidth = moved / max(large - small, 1e-9)
    return bandwidth, latency


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor counts its local shard)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        pointer, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or pointer in seen:
            continue
        seen.add(pointer)
        total += size
    return total


class ChunkOptimizers:
    """One optimizer per chunk (each chunk's policy decides which kind), stepped together.
    after_step(stage), if given, runs as soon as a chunk's optimizer has stepped (the
    DataParallel issues the next step's first gathers of the chunk there)."""

    def __init__(self, optimizers: Mapping[int, torch.optim.Optimizer], *,
                 after_step: Callable[[int], None] | None = None) -> None:
        self.by_stage = dict(optimizers)
        self.after_step = after_step

    def step(self) -> None:
        for stage, optimizer in self.by_stage.items():
            optimizer.step()
            if self.after_step is not None:
                self.after_step(stage)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.by_stage.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_tensors(self) -> list[torch.Tensor]:
        out = []
        for optimizer in self.by_stage.values():
            inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
            for state in inner.state.values():
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return out


class DPEvent(NamedTuple):
    """One entry of `DataParallel.events` (time: perf_counter seconds).

    kind: "reduce_in_pass" (a unit's reduction launched inside its stage's last
    weight-gradient pass), "reduce_at_op" (launched by its REDUCE_GRAD op), "pass_end" (the
    end of a pass that launched reductions), "gather_ahead" (the next step's gather issued
    after the chunk's optimizer step), "unshard_found_ahead" (an UNSHARD op that found its
    gather in flight), "step_start" (stage -1). unit: None for a whole chunk, and for the
    pass and step events."""

    kind: str
    stage: int
    unit: int | None
    time: float


@dataclass
class _Unit:
    """One unit of a chunk at block grain: its modules' parameters and, under FSDP2, the
    module whose unshard()/reshard() moves it."""

    index: int
    params: list[torch.Tensor]
    fsdp: FSDPModule | None = None
    handle: object | None = None
    gathered: bool = False
    reduced: bool = False
    launched: bool = False  # its reduction was launched inside the pass (REDUCE_GRAD finds it in flight)
    ahead: bool = False  # `handle` is the next step's gather, issued after the optimizer step


@dataclass
class _Chunk:
    stage: int
    policy: ShardingPolicy
    module: torch.nn.Module
    own_params: list[torch.Tensor]  # the registered parameters (DTensor shards under FSDP2)
    gathered: bool = False
    unshard_handle: object | None = None
    reductions: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    reducing: bool = False
    units: list[_Unit] | None = None  # block grain: the chunk's units (None: one, the chunk)
    buckets: list[GradBucket] = field(default_factory=list)
    readiness: GradReadiness | None = None  # block grain: launches each unit's reduction inside the pass
    ahead: bool = False  # chunk grain: `unshard_handle` is the next step's gather (after the optimizer step)


class DataParallel:
    """This rank's chunks on the dp group of the mesh; runs the Program's DP ops.

    stages: global stage -> module (this rank's). policies: one per global stage
    (`core.sharding.per_stage`). dp_mesh: the mesh's "dp" DeviceMesh; dp_group its group.
    Build it before the optimizer: FSDP2 replaces the parameters by their shards.
    link: an `emulated_link.EmulatedLink` under emulated compute (any policy): each DP op
    also takes its modelled link time, waited where the real one is (a zero3 chunk's first
    pass after its UNSHARD, the end of the step). reduce_at_end: lower every REDUCE_GRAD to the
    end of the rank's step instead of right after its stage's last weight gradient.
    units: the DP units of every global stage (`core.dp_units.DPUnits`; None: chunk grain);
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
        self.chunks: dict[int, _Chunk] = {}
        for stage, module in sorted(stages.items()):
            if not 0 <= stage < len(policies):
                raise ValueError(f"stage {stage} has no sharding policy: give one policy per stage ({len(policies)})")
            policy = ShardingPolicy(policies[stage])
            groups = unit_modules(module, units.sizes[stage]) if units is not None and units.count(stage) > 1 else None
            handles: list = [None] * len(groups or ())
            if policy in _FSDP:
                if groups is None:
                    extra = {"mp_policy": mp_policy} if mp_policy is not None else {}
                    fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, **extra)
                else:
                    handles = shard_units(module, groups, mesh=dp_mesh, mp_policy=mp_policy)
                _accumulate_only(module)
            chunk = _Chunk(stage, policy, module, list(module.parameters()))
            if groups is not None:
                chunk.units = [_Unit(u, [p for m in modules for p in m.parameters()], fsdp)
                               for u, (modules, fsdp) in enumerate(zip(groups, handles))]
                _check_units_cover(chunk)
                chunk.readiness = GradReadiness(stage, self._ready_callback(chunk))
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
        self.events: deque[DPEvent] = deque(maxlen=4096)  # what launched when (DPEvent); the latest kept
        self._last_weight_pass: dict[Action, int] = {}  # per stage at block grain: its reductions launch inside it
        self._leading: tuple[tuple[int, int | None], ...] = ()  # the gathers that open the rank's step
        self._armed: _Chunk | None = None

    def use_program(self, ops: Sequence[Op]) -> None:
        """The rank's ops of the Program the runner runs (the runner calls this): each stage's
        REDUCE_GRADs that directly follow a weight-gradient pass of the stage (only sends and
        DP ops between) are launched inside that pass, unit by unit, at block grain; the
        UNSHARDs before the rank's first other op are the gathers issued ahead."""
        self._last_weight_pass = {}
        seen: set[int] = set()
        for i, op in enumerate(ops):
            if type(op) is not DPOp or op.kind != "REDUCE_GRAD" or op.stage in seen or op.stage not in self.chunks:
                continue
            seen.add(op.stage)
            if self.chunks[op.stage].units is None:
                continue
            before = next((o for o in reversed(ops[:i]) if type(o) is Action or type(o) is Recompute), None)
            if type(before) is Action and before.stage == op.stage and before.kind in (Kind.W, Kind.BW):
                self._last_weight_pass[before] = op.stage
        leading = []
        for op in ops:
            if type(op) is not DPOp or op.kind != "UNSHARD":
                break
            if op.stage in self.chunks and self.chunks[op.stage].policy in _FSDP:
                leading.append((op.stage, op.unit))
        self._leading = tuple(leading)

    @property
    def compute(self):
        """The runner's compute object (set by the runner): it learns the gathered parameters,
        and emulated compute at block grain times its passes on the emulated link."""
        return self._compute

    @compute.setter
    def compute(self, compute) -> None:
        self._compute = compute
        if self.link is not None and self.link.has_units and hasattr(compute, "pass_timer"):
            compute.pass_timer = self.link.run_pass

    # ---- the optimizer ---------------------------------------------------------------
    def optimizer(self, optimizer_class: Callable[..., torch.optim.Optimizer], **defaults) -> ChunkOptimizers:
        """One optimizer per chunk: `optimizer_class` over its (sharded) parameters, or under
        ZeroRedundancyOptimizer on the dp group for zero1 chunks. Its `step` issues the next
        step's first gathers of each zero3 chunk once that chunk has stepped (`gather_ahead`)."""
        optimizers: dict[int, torch.optim.Optimizer] = {}
        for stage, chunk in self.chunks.items():
            params = [p for p in chunk.own_params if p.requires_grad]
            if chunk.policy is ShardingPolicy.ZERO1:
                optimizers[stage] = ZeroRedundancyOptimizer(
                    params, optimizer_class=optimizer_class, process_group=self.group, **defaults
                )
            else:
                optimizers[stage] = optimizer_class(params, **defaults)
        self.optimizers = ChunkOptimizers(optimizers, after_step=self._after_optimizer_step)
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
        if action is not None and self._last_weight_pass.get(action) == stage:
            self._arm(chunk)

    def _gather(self, chunk: _Chunk) -> None:
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
        if self._armed is not None:
            chunk, self._armed = self._armed, None
            if chunk.readiness.disarm():
                self.events.append(DPEvent("pass_end", chunk.stage, None, self._compute_end))

    def _arm(self, chunk: _Chunk) -> None:
        """Before the stage's last weight-gradient pass: watch each unit's leaves (the
        gathered parameters under FSDP2), so that `_launch` runs as each unit completes."""
        if self._armed is not None:
            self._armed.readiness.disarm()
        fsdp = chunk.policy in _FSDP
        chunk.readiness.arm([unsharded_leaves(u.fsdp) if fsdp else u.params for u in chunk.units])
        self._armed = chunk

    def _ready_callback(self, chunk: _Chunk) -> Callable[[int], None]:
        def ready(index: int) -> None:
            self._launch(chunk, chunk.units[index])

        return ready

    def _launch(self, chunk: _Chunk, unit: _Unit) -> None:
        """A unit's gradients are complete inside its stage's last weight-gradient pass:
        launch its reduction now (the REDUCE_GRAD op that follows finds it in flight). The
        static bytes are sampled first, where the REDUCE_GRAD would sample them."""
        self.sample_static()
        unit.launched = True
        self.events.append(DPEvent("reduce_in_pass", chunk.stage, unit.index, time.perf_counter()))
        self._start_reduction(chunk, unit)

    def _start_reduction(self, chunk: _Chunk, unit: _Unit) -> None:
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
        if self._armed is not None:  # a step that failed inside the pass
            self._armed.readiness.disarm()
            self._armed = None
        self.events.append(DPEvent("step_start", -1, None, time.perf_counter()))

    # ---- the next step's first gathers -------------------------------------------------
    def _after_optimizer_step(self, stage: int) -> None:
        """`stage`'s optimizer has stepped: issue the gathers that open the next step for it
        (the rank's leading UNSHARDs of the stage), so the next step's UNSHARD finds them in
        flight. FSDP2 keeps the parameters sharded until they are waited (the next step's
        first pass of the chunk), so a checkpoint or an evaluation in between sees them
        sharded, and the static bytes sampled after the optimizer step do not count them."""
        if not self.gather_ahead:
            return
        chunk = self.chunks.get(stage)
        for s, index in self._leading:
            if s != stage:
                continue
            if index is None:
                if chunk.gathered or chunk.unshard_handle is not None:
                    continue
                chunk.unshard_handle = chunk.module.unshard(async_op=True)
                chunk.ahead = True
            else:
                unit = chunk.units[index]
                if unit.gathered or unit.handle is not None:
                    continue
                unit.handle = unit.fsdp.unshard(async_op=True)
                unit.ahead = True
            self.events.append(DPEvent("gather_ahead", stage, index, time.perf_counter()))

    def drop_gathers_ahead(self) -> None:
        """Wait for the gathers issued ahead and free them again (after the last step, or
        before the parameters change outside an optimizer step, e.g. a checkpoint load
        between steps: a gather in flight holds the values of when it was issued)."""
        for chunk in self.chunks.values():
            if chunk.ahead:
                handle, chunk.unshard_handle, chunk.ahead = chunk.unshard_handle, None, False
                handle.wait()
                chunk.module.reshard()
            for unit in chunk.units or ():
                if unit.ahead:
                    handle, unit.handle, unit.ahead = unit.handle, None, False
                    handle.wait()
                    unit.fsdp.reshard()

    # ---- static bytes ------------------------------------------------------------------
    def static_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for chunk in self.chunks.values():
            for param in (*chunk.own_params, *chunk.module.parameters()):
                tensors.append(param)
                tensors.append(param.grad)
            if chunk.policy in _FSDP:
                tensors.extend(accumulated_grads(chunk.module))
                # a gather issued and not yet waited holds its buffer already
                if chunk.unshard_handle is not None:
                    tensors.extend(gathers_in_flight(chunk.module))
                tensors.extend(t for unit in chunk.units or () if unit.handle is not None
                               for t in gathers_in_flight(unit.fsdp))
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
    def _unit(self, chunk: _Chunk, op: DPOp) -> _Unit | None:
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

    def _unshard(self, chunk: _Chunk) -> None:
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

    def _unshard_unit(self, chunk: _Chunk, unit: _Unit) -> None:
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

    def _reshard(self, chunk: _Chunk) -> None:
        if chunk.unshard_handle is not None:
            raise RuntimeError(f"{chunk.stage}RESHARD: its UNSHARD is still pending (no pass of the stage ran)")
        if chunk.policy in _FSDP and chunk.gathered:
            chunk.module.reshard()
            chunk.gathered = False

    def _reshard_unit(self, chunk: _Chunk, unit: _Unit) -> None:
        if unit.handle is not None:
            raise RuntimeError(f"{chunk.stage}RESHARD.{unit.index}: its UNSHARD is still pending (no pass of the "
                               "stage ran)")
        if chunk.policy in _FSDP and unit.gathered:
            unit.fsdp.reshard()
            unit.gathered = False
            if not any(u.gathered for u in chunk.units):
                chunk.module.reshard()
                chunk.gathered = False

    def _reduce(self, chunk: _Chunk) -> None:
        if chunk.reducing:
            raise RuntimeError(f"{chunk.stage}REDUCE_GRAD: stage {chunk.stage} reduced twice in one step")
        chunk.reducing = True
        if chunk.policy in _FSDP:
            start = time.perf_counter()
            _reduce_scatter(chunk.module, reshard=chunk.policy is ShardingPolicy.ZERO2)
            if self.link is None:  # under a link its modelled reduce-scatter is the one counted
                self.wait_s += time.perf_counter() - start
            if chunk.policy is ShardingPolicy.ZERO2:
                chunk.gathered = False
            return
        for param in chunk.own_params:
            if param.grad is not None:
                work = dist.all_reduce(param.grad, group=self.group, async_op=True)
                chunk.reductions.append((work, param.grad))

    def _reduce_unit(self, chunk: _Chunk, unit: _Unit) -> None:
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

    def _show_parameters(self, chunk: _Chunk) -> None:
        params = list(chunk.module.parameters())
        if self.compute is not None:
            self.compute.use_parameters(chunk.stage, [p for p in params if p.requires_grad])
        if self.tracker is not None:
            self.tracker.also_exclude(params)


def _check_units_cover(chunk: _Chunk) -> None:
    """Every parameter of a chunk at block grain in exactly one unit, but those of parts
    shared by every stage (the root's own)."""
    seen: dict[int, int] = {}
    for unit in chunk.units:
        for param in unit.params:
            if id(param) in seen:
                raise ValueError(f"stage {chunk.stage}: a parameter is in DP units {seen[id(param)]} and {unit.index}; "
                                 "a unit holds whole blocks, each block in one unit")
            seen[id(param)] = unit.index


def _accumulate_only(module: FSDPModule) -> None:
    """Per microbatch: no reduce-scatter, no reshard, not the last backward (FSDP2 flags)."""
    module.set_requires_gradient_sync(False)
    module.set_reshard_after_backward(False)
    module.set_is_last_backward(False)


def _reduce_scatter(module: FSDPModule, *, reshard: bool) -> None:
    """FSDP2's post-backward for the whole module with gradient sync on: reduce-scatters the
    accumulated gradients into the sharded parameters' `.grad` (as torch's pipelining
    schedules do at REDUCE_GRAD); then back to accumulate-only for the next step."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(reshard)
    module.set_requires_gradient_sync(True)
    try:
        state = fully_shard.state(module)
        for inner in state._state_ctx.all_states:
            for group in inner._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
    finally:
        _accumulate_only(module)
