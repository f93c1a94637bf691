"""Tied input and output embeddings over a pipeline: two copies of one weight, kept equal.

    tied = TiedWeights.build(my_stages, placement, mesh=mesh)     # every rank calls it (it makes groups)
    runner.step(...)                                               # gradients accumulated, DP reduced
    tied.sum_gradients()                                           # both copies now hold the sum
    optimizer.step()                                               # equal weights, equal gradients: equal after

A model whose head shares the embedding's weight (`tie_word_embeddings`) has that weight on
the first stage and on the last. Each holds a copy, equal at the start (both are filled
from the embedding's values), and the gradient of the tied weight is the sum of the two
copies' gradients. Before the optimizer step the two ranks that hold the copies add them
up with one all-reduce over a group of those two ranks (per data-parallel replica and
tensor-parallel rank), as Megatron-LM's embedding group does; when one rank holds both (a
V placement puts stage 0 and the last stage on rank 0) the sum is local and nothing is
sent. With equal weights, equal gradients and equal optimizer state, AdamW keeps the two
equal after every step, under every sharding: FSDP2 shards the two [V, h] copies alike,
so the local shards hold the same elements and are summed shard by shard.

The gradient norm of the run (clipping, the non-finite check) counts the tied weight once:
`counted_twice` names the last stage's copies, which the norm leaves out.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TiedWeights"]


@dataclass
class TiedWeights:
    """The tied pairs this rank holds an end of, and the group that sums them (None: local)."""

    first: dict[str, nn.Parameter]
    """the first stage's copies on this rank, by pair (the embedding's name)"""
    last: dict[str, nn.Parameter]
    """the last stage's copies on this rank, by the same key"""
    group: Any = None
    """the two ranks holding the ends; None when this rank holds both, or neither"""
    timeout: Any = None
    source: int = 0
    """the global rank of this group's first-stage end (what `copy_first_to_last` broadcasts from)"""
    sums: int = field(default=0)

    @staticmethod
    def build(stages: Mapping[int, nn.Module], placement, *, mesh=None, timeout_s: float | None = None
              ) -> TiedWeights | None:
        """The tie state of this rank's `stages` (global index -> `models.stage.Stage`); None for a
        model without tied weights. Every rank of the run calls it: it creates process groups."""
        pairs = next((stage.tied for stage in stages.values()), ())
        if not pairs:
            return None
        num_stages = placement.num_stages
        first_rank, last_rank = placement.rank_of(0), placement.rank_of(num_stages - 1)
        first = {p.first: _parameter(stages[0], p.first) for p in pairs} if 0 in stages else {}
        last = {p.first: _parameter(stages[num_stages - 1], p.last) for p in pairs} if num_stages - 1 in stages else {}
        group, source = None, 0
        if first_rank != last_rank and dist.is_available() and dist.is_initialized():
            group = _pair_group(first_rank, last_rank, mesh)
            source = mesh.global_rank(first_rank) if mesh is not None else first_rank
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        return TiedWeights(first, last, group if (first or last) else None, timeout, source)

    def copy_first_to_last(self) -> None:
        """Give the last stage's copies the first stage's values (after a resume from a checkpoint,
        which holds the tied weight once): locally, or by a broadcast over the pair's group."""
        with torch.no_grad():
            for key in sorted(set(self.first) | set(self.last)):
                first, last = self.first.get(key), self.last.get(key)
                if first is not None and last is not None:
                    _local(last).copy_(_local(first))
                elif self.group is not None:
                    end = first if first is not None else last
                    work = dist.broadcast(_local(end.data), src=self.source, group=self.group, async_op=True)
                    work.wait(self.timeout) if self.timeout is not None else work.wait()

    @property
    def counted_twice(self) -> list[nn.Parameter]:
        """The copies a gradient norm leaves out, so that the tied weight counts once."""
        return list(self.last.values())

    def sum_gradients(self) -> None:
        """Give both copies of every tied weight the sum of their gradients."""
        with torch.no_grad():
            for key in sorted(set(self.first) | set(self.last)):
                ends = [p for p in (self.first.get(key), self.last.get(key)) if p is not None]
                grads = [_grad(p) for p in ends]
                if len(ends) == 2:
                    total = grads[0] + grads[1]
                    for p in ends:
                        _set_grad(p, total)
                elif self.group is not None:
                    local = _local(grads[0])
                    work = dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                    work.wait(self.timeout) if self.timeout is not None else work.wait()
                    _set_grad(ends[0], grads[0])
        self.sums += 1


def _parameter(stage: nn.Module, name: str) -> nn.Parameter:
    return dict(stage.named_parameters())[name]


def _grad(param: nn.Parameter) -> torch.Tensor:
    """The parameter's gradient (zeros where the step left none)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def _set_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    if param.grad is not value:
        param.grad.copy_(value)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (an FSDP2 or tensor-parallel shard), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _pair_group(first_rank: int, last_rank: int, mesh) -> Any:
    """This process's group of the two pipeline ranks holding the ends: one group per (replica,
    tensor-parallel rank), each created by every process in the same order."""
    if mesh is None:
        return dist.new_group([first_rank, last_rank])
    mine = None
    for replica in range(mesh.dp):
        for tp_rank in range(mesh.tp):
            ranks = [mesh.global_rank(first_rank, replica, tp_rank), mesh.global_rank(last_rank, replica, tp_rank)]
            group = dist.new_group(sorted(ranks))
            if replica == mesh.dp_rank and tp_rank == mesh.tp_rank:
                mine = group
    return mine
