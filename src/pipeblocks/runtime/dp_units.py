"""DP units in the runtime: a chunk's parameters gathered and reduced per unit of blocks.

    groups = unit_modules(stage, (1, 1, 1))              # per unit: its blocks (+ embedding / head)
    handles = shard_units(stage, groups, mesh=dp_mesh)   # fully_shard per unit, then the stage as root
    handles[1].unshard(async_op=True)                    # UNSHARD.1
    reduce_scatter_unit(handles[1], reshard=False)       # REDUCE_GRAD.1: this unit's reduce-scatter
    finish_reduce_scatter(stage)                         # after the chunk's last unit

As torchtitan wraps every transformer block, each unit is one FSDP2 parameter group
(`fully_shard(blocks)`, the embedding with the first block and the final norm and head
with the last, `fully_shard([embed, block0])` grouping them), and the stage module is the
root over them, which owns nothing but parts shared by every stage. FSDP2 runs its own
hooks as usual (gather at pre-forward if not gathered, accumulate at post-backward), with
gradient sync off for every microbatch; a unit's REDUCE_GRAD runs its group's
post-backward with sync on, which launches that unit's reduce-scatter (asynchronous on an
accelerator), and the chunk's last one also runs the root's final callback, which waits
for them and leaves every group idle for the next step.

Replicated units (replicate, zero1) are gradient buckets: `GradBucket` flattens a unit's
gradients (torch's `_flatten_dense_tensors`, as DDP's buckets do) and all-reduces them in
one asynchronous collective; the end of the step waits, copies back and averages.

When each unit's gradients are complete (`GradReadiness`): during a chunk's last
weight-gradient pass of the step, a post-accumulate-grad hook on every trainable leaf of
every unit counts the leaves whose gradient autograd has accumulated, and once a unit's
last one is in, calls back with the unit, while the pass goes on to the blocks below (a
backward runs the blocks in reverse), as DDP's reducer marks a bucket ready. The leaves are
the module parameters of a replicated unit and FSDP2's unsharded parameters of a sharded
one (`unsharded_leaves`: what the forward used, whose `.grad` FSDP2's post-backward
reduces). The hooks work alike for a fused backward (BW) and a split one's W
(`backward.WeightGradWork`, one engine call per parameter group): FSDP2's own post-backward
hook sits on each unit's input, which a W pass never reaches, so it cannot be the trigger.
"""
from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["GradBucket", "GradReadiness", "accumulated_grads", "finish_reduce_scatter", "gathers_in_flight",
           "reduce_scatter_unit", "shard_units", "unit_modules", "unsharded_leaves"]


def unit_modules(stage: nn.Module, sizes: Sequence[int]) -> list[list[nn.Module]]:
    """The modules of each unit of `stage` (a `models.Stage`): `sizes[u]` consecutive blocks,
    the first unit with the stage's before-parts (embedding) in front, the last with its
    after-parts (final norm, head) behind. A ValueError when the stage's blocks do not match."""
    items = getattr(stage, "block_items", None)
    if items is None:
        raise ValueError(
            f"DP units of blocks need stage modules that list their blocks (pipeblocks.models.Stage, "
            f"block_items()); got {type(stage).__name__}: use --dp-unit chunk, or build the stages with "
            "pipeblocks.models (family.build_stages or the splitter)"
        )
    blocks = [module for _, module in items()]
    index = getattr(stage, "index", "?")
    if sum(sizes) != len(blocks):
        raise ValueError(f"stage {index} has {len(blocks)} blocks but its DP units hold {sum(sizes)} "
                         f"({tuple(sizes)}): build the units from the stage's blocks (DPUnits.per_block)")
    groups, start = [], 0
    for size in sizes:
        groups.append(blocks[start:start + size])
        start += size
    groups[0] = [*_parts(stage, stage.layout.before), *groups[0]]
    groups[-1] = [*groups[-1], *_parts(stage, stage.layout.after)]
    return groups


def _parts(stage: nn.Module, paths: Sequence[str]) -> list[nn.Module]:
    found = []
    for path in paths:
        try:
            found.append(stage.part(path))
        except KeyError:  # not on this stage: the embedding is on stage 0 only, the head on the last
            continue
    return found


def shard_units(root: nn.Module, groups: Sequence[Sequence[nn.Module]], *, mesh, mp_policy=None) -> list[FSDPModule]:
    """`fully_shard` each unit's modules (one parameter group each), then `root` over them;
    every module keeps its gathered parameters after forward (a pipeline step reuses them
    for all its microbatches). Returns per unit the FSDP module whose unshard()/reshard()
    moves it."""
    extra = {"mp_policy": mp_policy} if mp_policy is not None else {}
    handles = []
    for modules in groups:
        target = list(modules) if len(modules) > 1 else modules[0]
        fully_shard(target, mesh=mesh, reshard_after_forward=False, **extra)
        handles.append(modules[0])
    fully_shard(root, mesh=mesh, reshard_after_forward=False, **extra)
    return handles


def reduce_scatter_unit(unit: FSDPModule, *, reshard: bool) -> None:
    """One unit's reduce-scatter of its accumulated gradients (its group's post-backward with
    gradient sync on); back to accumulate-only after."""
    unit.set_requires_gradient_sync(True, recurse=False)
    unit.set_reshard_after_backward(reshard, recurse=False)
    try:
        for group in fully_shard.state(unit)._fsdp_param_groups:
            group.post_backward()
    finally:
        unit.set_requires_gradient_sync(False, recurse=False)
        unit.set_reshard_after_backward(False, recurse=False)


def finish_reduce_scatter(root: FSDPModule, *, reshard: bool) -> None:
    """After every unit's reduce-scatter: the root's own group (parts shared by every stage,
    if they hold parameters) and FSDP2's final callback, which waits for the reductions and
    readies every group for the next step; then accumulate-only again."""
    root.set_is_last_backward(True)
    root.set_requires_gradient_sync(True, recurse=False)
    root.set_reshard_after_backward(reshard, recurse=False)
    try:
        fully_shard.state(root)._root_post_backward_final_callback()
    finally:
        root.set_requires_gradient_sync(False)
        root.set_reshard_after_backward(False)
        root.set_is_last_backward(False)


def accumulated_grads(module: nn.Module) -> list[torch.Tensor]:
    """The gradients FSDP2 accumulates beside the parameters when its reduce dtype differs
    from its parameter dtype (bf16-mixed: float32 sums of the bfloat16 microbatch gradients,
    held unsharded until the reduce-scatter), over every FSDP2 group in `module`. Read from
    FSDP2's internals where they are (torch 2.13); a torch without them shows none."""
    out, seen = [], set()
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        for group in getattr(sub._get_fsdp_state(), "_fsdp_param_groups", ()):
            if id(group) in seen:
                continue
            seen.add(id(group))
            out.extend(t for t in (getattr(p, "unsharded_accumulated_grad", None) for p in group.fsdp_params)
                       if t is not None)
    return out


class GradBucket:
    """One unit's gradients all-reduced as one flat tensor, asynchronously; `wait` copies the
    sums back and averages them over the replicas."""

    def __init__(self, grads: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
        self.grads = [g for g in grads if g is not None]
        self.flat = _flatten_dense_tensors(self.grads) if self.grads else None
        self.work = dist.all_reduce(self.flat, group=group, async_op=True) if self.flat is not None else None

    def wait(self, timeout: datetime.timedelta, d: int) -> None:
        if self.work is None:
            return
        self.work.wait(timeout)
        for grad, summed in zip(self.grads, _unflatten_dense_tensors(self.flat, self.grads)):
            grad.copy_(summed).div_(d)
        self.flat = self.work = None


def unsharded_leaves(unit: FSDPModule) -> list[torch.Tensor]:
    """The tensors autograd accumulates `unit`'s gradients into while it is gathered: FSDP2's
    unsharded parameters (each made at the unit's first gather and kept, its storage freed
    and refilled, across reshards). Empty before the first gather."""
    return [param._unsharded_param for group in fully_shard.state(unit)._fsdp_param_groups
            for param in group.fsdp_params if hasattr(param, "_unsharded_param")]


def gathers_in_flight(module: FSDPModule) -> list[torch.Tensor]:
    """The output buffers of `module`'s all-gathers issued (`unshard(async_op=True)`) and not
    yet waited: memory the gather holds from its issue, before FSDP2 registers the gathered
    parameters at the wait."""
    buffers = []
    for group in fully_shard.state(module)._fsdp_param_groups:
        result = getattr(group, "_all_gather_result", None)
        if result is not None:
            buffers.append(result.all_gather_output)
    return buffers


class GradReadiness:
    """Calls `ready(unit)` as soon as every trainable leaf of the unit has had its gradient
    accumulated in the armed pass (the module doc). `arm(leaves)` before the pass, with the
    leaves of each unit (a unit with a leaf that is not a leaf tensor, or with none, is left
    out: its reduction waits for its REDUCE_GRAD op); `disarm()` after it returns the units
    that were ready. A gradient accumulated into a unit already handed to `ready` in the
    same pass would be missed by its reduction: that raises."""

    def __init__(self, stage: int, ready: Callable[[int], None]) -> None:
        self.stage = stage
        self.ready = ready
        self._hooked: dict[int, tuple[torch.Tensor, object]] = {}  # leaf id -> (leaf, hook handle)
        self._unit_of: dict[int, int] = {}
        self._pending: dict[int, set[int]] | None = None  # unit -> ids of leaves not yet accumulated
        self._done: list[int] = []

    @property
    def armed(self) -> bool:
        return self._pending is not None

    def arm(self, leaves: Sequence[Sequence[torch.Tensor]]) -> None:
        self._pending, self._done = {}, []
        for unit, tensors in enumerate(leaves):
            trainable = [t for t in tensors if t.requires_grad]
            if not trainable or any(not t.is_leaf for t in trainable):
                continue
            ids = set()
            for leaf in trainable:
                key = id(leaf)
                if key not in self._hooked:
                    self._hooked[key] = (leaf, leaf.register_post_accumulate_grad_hook(self._accumulated))
                self._unit_of[key] = unit
                ids.add(key)
            self._pending[unit] = ids

    def disarm(self) -> list[int]:
        """Stop watching; the units handed to `ready`, in the order they were."""
        done, self._pending, self._done = self._done, None, []
        return done

    def remove(self) -> None:
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked.clear()
        self._unit_of.clear()

    def _accumulated(self, leaf: torch.Tensor) -> None:
        if self._pending is None:
            return
        unit = self._unit_of.get(id(leaf))
        pending = self._pending.get(unit)
        if pending is None:
            if unit in self._done:
                raise RuntimeError(
                    f"stage {self.stage} unit {unit}: a gradient of shape {tuple(leaf.shape)} was accumulated after the "
                    "unit's reduction was launched inside its last weight-gradient pass, so the reduction misses it; "
                    "a parameter reached twice by one pass (shared across units?) must belong to one unit, or run "
                    "with --dp-unit chunk"
                )
            return
        pending.discard(id(leaf))
        if not pending:
            del self._pending[unit]
            self._done.append(unit)
            self.ready(unit)
