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
does), once per chunk per step.

Static bytes (`held_bytes`): parameters, gradients and optimizer state this process holds,
counted once per storage (sharded and gathered parameters both count as parameters). The
peak is sampled where it can occur: before each op that frees (REDUCE_GRAD, RESHARD) and
after the optimizer step. What each policy holds at that peak, for a chunk of P parameter
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
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..core.program import DPOp
from ..core.sharding import ShardingPolicy
from .comm import PeerTimeoutError
from .emulated_link import EmulatedLink
from .static_memory import zero1_partition

__all__ = ["DataParallel", "ChunkOptimizers", "held_bytes", "measure_link", "zero1_partition"]

_FSDP = (ShardingPolicy.ZERO2, ShardingPolicy.ZERO3)


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
    """One optimizer per chunk (each chunk's policy decides which kind), stepped together."""

    def __init__(self, optimizers: Mapping[int, torch.optim.Optimizer]) -> None:
        self.by_stage = dict(optimizers)

    def step(self) -> None:
        for optimizer in self.by_stage.values():
            optimizer.step()

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


class DataParallel:
    """This rank's chunks on the dp group of the mesh; runs the Program's DP ops.

    stages: global stage -> module (this rank's). policies: one per global stage
    (`core.sharding.per_stage`). dp_mesh: the mesh's "dp" DeviceMesh; dp_group its group.
    Build it before the optimizer: FSDP2 replaces the parameters by their shards.
    link: an `emulated_link.EmulatedLink` under emulated compute (any policy): each DP op
    also takes its modelled link time, waited where the real one is (a zero3 chunk's first
    pass after its UNSHARD, the end of the step). reduce_at_end: lower every REDUCE_GRAD to the
    end of the rank's step instead of right after its stage's last weight gradient.
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
    ) -> None:
        self.dp_mesh = dp_mesh
        self.group = dp_mesh.get_group()
        self.d = dist.get_world_size(self.group)
        self.timeout_s = float(timeout_s)
        self.link = link
        self.reduce_at_end = bool(reduce_at_end)  # the no-overlap baseline: every REDUCE_GRAD at the end
        self.chunks: dict[int, _Chunk] = {}
        for stage, module in sorted(stages.items()):
            if not 0 <= stage < len(policies):
                raise ValueError(f"stage {stage} has no sharding policy: give one policy per stage ({len(policies)})")
            policy = ShardingPolicy(policies[stage])
            if policy in _FSDP:
                extra = {"mp_policy": mp_policy} if mp_policy is not None else {}
                fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, **extra)
                _accumulate_only(module)
            self.chunks[stage] = _Chunk(stage, policy, module, list(module.parameters()))
        self.policies = tuple(ShardingPolicy(p) for p in policies)
        self.extra_static = extra_static  # tensors held beside the chunks' (the compute copies of bf16-mixed)
        self.compute = None  # set by the runner: its compute object learns the gathered parameters
        self.tracker = None  # set by the runner: gathered parameters are not activations
        self.optimizers: ChunkOptimizers | None = None
        self.wait_s = 0.0
        self.peak_static = 0

    # ---- the optimizer ---------------------------------------------------------------
    def optimizer(self, optimizer_class: Callable[..., torch.optim.Optimizer], **defaults) -> ChunkOptimizers:
        """One optimizer per chunk: `optimizer_class` over its (sharded) parameters, or under
        ZeroRedundancyOptimizer on the dp group for zero1 chunks."""
        optimizers: dict[int, torch.optim.Optimizer] = {}
        for stage, chunk in self.chunks.items():
            params = [p for p in chunk.own_params if p.requires_grad]
            if chunk.policy is ShardingPolicy.ZERO1:
                optimizers[stage] = ZeroRedundancyOptimizer(
                    params, optimizer_class=optimizer_class, process_group=self.group, **defaults
                )
            else:
                optimizers[stage] = optimizer_class(params, **defaults)
        self.optimizers = ChunkOptimizers(optimizers)
        return self.optimizers

    # ---- the DP ops --------------------------------------------------------------------
    def run(self, op: DPOp) -> None:
        """Run one DP op of the Program (on the communication side: it does not wait)."""
        chunk = self.chunks.get(op.stage)
        if chunk is None:
            raise ValueError(f"{op}: stage {op.stage} is not on this rank (stages {sorted(self.chunks)})")
        if op.kind == "UNSHARD":
            self._unshard(chunk)
        elif op.kind == "RESHARD":
            self.sample_static()
            self._reshard(chunk)
        elif op.kind == "REDUCE_GRAD":
            self.sample_static()
            self._reduce(chunk)
        else:
            raise ValueError(f"the runtime does not run DP op kind {op.kind!r} ({op})")
        if self.link is not None:
            self.link.issue(op.kind, op.stage)

    def before_compute(self, stage: int) -> None:
        """Called before every pass of `stage`: the parameters must be gathered (zero3 waits
        for its UNSHARD; zero2 gathers at its first pass of the step)."""
        chunk = self.chunks[stage]
        if chunk.gathered or chunk.policy not in _FSDP:
            return
        start = time.perf_counter()
        if chunk.unshard_handle is None:
            chunk.module.unshard()
        else:
            handle, chunk.unshard_handle = chunk.unshard_handle, None
            handle.wait()
        if self.link is not None:
            # the modelled gather issued at the UNSHARD is the one counted; zero2's gather
            # here is modelled after the optimizer step (`EmulatedLink.finish`)
            start = time.perf_counter()
            self.link.wait_stage(stage)
        self.wait_s += time.perf_counter() - start
        chunk.gathered = True
        self._show_parameters(chunk)

    def finish(self) -> None:
        """The end of the step: wait for every reduction (the optimizer needs them)."""
        start = time.perf_counter()
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for chunk in self.chunks.values():
            for work, grad in chunk.reductions:
                try:
                    work.wait(timeout)
                except RuntimeError as err:
                    if "imeout" in str(err) or "imed out" in str(err):
                        raise PeerTimeoutError(
                            f"stage {chunk.stage}: the gradient all-reduce over the {self.d} replicas did not finish "
                            f"within {self.timeout_s:g} s: a replica failed or hangs"
                        ) from None
                    raise
                grad.div_(self.d)
            chunk.reductions = []
            if self.link is not None:
                self.link.wait_stage(chunk.stage)
            chunk.reducing = False
            if chunk.unshard_handle is not None:
                raise RuntimeError(f"stage {chunk.stage}: the step ended with an UNSHARD never used; add its passes")
            if chunk.gathered and chunk.policy in _FSDP:
                raise RuntimeError(f"stage {chunk.stage}: the step ended with its parameters gathered; RESHARD it")
        if self.link is not None:
            self.link.finish(sorted(self.chunks))
        self.wait_s += time.perf_counter() - start

    def after_shape_pass(self) -> None:
        """The shape pass may have run (and so gathered) a chunk's forward: free it again, so
        that every step starts with sharded parameters."""
        for chunk in self.chunks.values():
            if chunk.policy in _FSDP:
                chunk.module.reshard()
                chunk.gathered = False

    def reset_step(self) -> None:
        self.wait_s = 0.0
        self.peak_static = 0

    # ---- static bytes ------------------------------------------------------------------
    def static_tensors(self) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for chunk in self.chunks.values():
            for param in (*chunk.own_params, *chunk.module.parameters()):
                tensors.append(param)
                tensors.append(param.grad)
            if chunk.policy in _FSDP:
                tensors.extend(_accumulated_grads(chunk.module))
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
    def _unshard(self, chunk: _Chunk) -> None:
        if chunk.policy not in _FSDP:
            raise ValueError(
                f"{chunk.stage}UNSHARD: stage {chunk.stage} is {chunk.policy}, its parameters are not sharded; "
                "UNSHARD is for zero3 chunks"
            )
        if chunk.gathered or chunk.unshard_handle is not None:
            raise RuntimeError(f"{chunk.stage}UNSHARD: stage {chunk.stage} is already gathered")
        chunk.unshard_handle = chunk.module.unshard(async_op=True)

    def _reshard(self, chunk: _Chunk) -> None:
        if chunk.unshard_handle is not None:
            raise RuntimeError(f"{chunk.stage}RESHARD: its UNSHARD is still pending (no pass of the stage ran)")
        if chunk.policy in _FSDP and chunk.gathered:
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

    def _show_parameters(self, chunk: _Chunk) -> None:
        params = list(chunk.module.parameters())
        if self.compute is not None:
            self.compute.use_parameters(chunk.stage, [p for p in params if p.requires_grad])
        if self.tracker is not None:
            self.tracker.also_exclude(params)


def _accumulated_grads(module: FSDPModule) -> list[torch.Tensor]:
    """The gradients FSDP2 accumulates beside the parameters when its reduce dtype differs
    from its parameter dtype (bf16-mixed: float32 sums of the bfloat16 microbatch gradients,
    held unsharded until the reduce-scatter). Read from FSDP2's internals where they are
    (torch 2.13); a torch without them shows none."""
    state = getattr(module, "_get_fsdp_state", None)
    group = getattr(state(), "_fsdp_param_group", None) if state is not None else None
    params = getattr(group, "fsdp_params", ()) if group is not None else ()
    return [t for t in (getattr(p, "unsharded_accumulated_grad", None) for p in params) if t is not None]


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
