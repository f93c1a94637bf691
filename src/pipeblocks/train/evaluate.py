"""The held-out loss of a pipeline-parallel model: forward passes only, through every rank.

    >>> loss = held_out_loss(stages, loss_fn, placement, rank=r, batch=held.eval_batch(m * b), microbatches=m,
    ...                      group=pp_group, device=device)     # on every pipeline rank; the loss on the last stage's

`--eval-every N` calls it after every N-th step and after the last. The batch is the same
every time (`TokenWindows.eval_batch`: evenly spaced windows of the held-out tail of the
data, which never trains). Each microbatch goes through the stages in order, stage s on
the rank that holds it: a stage's output is handed over locally when the next stage is on
the same rank (a V's turn) and sent otherwise; nothing is pipelined, no graph is built.
The loss is the mean over the microbatches, on the rank holding the last stage (None on
the others). Every replica of a data-parallel run evaluates the same batch (FSDP2 gathers
the shards of its chunks as in training).

An activation crosses as a pickled object (`send_object_list`): a tensor, or a tuple or
dict of them, on any backend; evaluation is rare enough for that.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

__all__ = ["held_out_loss"]


@torch.no_grad()
def held_out_loss(stages: Mapping[int, torch.nn.Module], loss_fn: Callable, placement, *, rank: int,
                  batch: tuple[torch.Tensor, torch.Tensor], microbatches: int, group=None,
                  device: torch.device | None = None, num_stages: int | None = None) -> float | None:
    """The mean loss of `batch` cut into `microbatches` (see the module doc). `num_stages`:
    through the first stages only (DualPipe: its first direction, stages 0..L-1 of 2L)."""
    inputs, targets = batch
    count = placement.num_stages if num_stages is None else num_stages
    last = count - 1
    mine = set(placement.stages_of(rank))
    total = 0.0
    for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
        value = x.to(device) if device is not None else x
        for s in range(count):
            owner = placement.rank_of(s)
            if s > 0 and placement.rank_of(s - 1) != owner:
                if owner == rank:
                    value = _receive(placement.rank_of(s - 1), group, device)
                elif placement.rank_of(s - 1) == rank:
                    _send(value, owner, group, device)
            if owner != rank:
                continue
            if s not in mine:
                raise RuntimeError(f"rank {rank}: stage {s} is placed here but not built here")
            value = stages[s](value)
            if s == last:
                total += float(loss_fn(value, y.to(value.device)))
    return total / microbatches if last in mine else None


def _peer(group, peer: int) -> int:
    return peer if group is None else dist.get_global_rank(group, peer)


def _send(value, peer: int, group, device) -> None:
    dist.send_object_list([_to(value, torch.device("cpu"))], dst=_peer(group, peer), group=group,
                          device=_comm_device(device))


def _receive(peer: int, group, device):
    box = [None]
    dist.recv_object_list(box, src=_peer(group, peer), group=group, device=_comm_device(device))
    return _to(box[0], device)


def _comm_device(device):
    return device if device is not None and torch.device(device).type == "cuda" else None


def _to(value, device):
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
