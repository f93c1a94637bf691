"""Measured saved-activation memory: what autograd keeps for the backward, per rank.

`SavedTensorTracker` wraps forwards in `saved_tensors_hooks`. Every tensor autograd saves
is packed into a small handle; the handle counts the tensor's *storage* once (views and
repeated saves of one storage count once) and uncounts it when the last handle of that
storage is freed, which happens when the graph releases its saved tensors (after a fused
backward, after W, or when the graph is dropped). Parameters and buffers are not
activations and are not counted. Tensors the executor holds outside the graph (the
stage output until its backward, received gradients, send buffers) are not counted
either: the number is autograd's saved-activation footprint, the quantity the
simulator's memory model (ALGORITHMS.md §1.3) predicts.

`profile_stage_memory` measures, for one microbatch through a list of stage modules in one
process, what each stage's F saves (M_B) and what its B keeps for W (M_W), to feed
`pipeblocks.sim.Costs(mem_b=..., mem_w_ratio=...)`. `profile_chunk_memory` measures, for
a sequence-chunk schedule, what each chunk saves relative to the whole microbatch (with
its K/V prefix), to feed `Costs(seq_mem=...)`.
"""
from __future__ import annotations

import contextlib

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from .backward import input_backward

__all__ = ["SavedTensorTracker", "StageMemory", "profile_stage_memory", "profile_chunk_memory"]


class _Saved:
    """One saved tensor; counted while alive."""

    __slots__ = ("tensor", "key", "tracker")

    def __init__(self, tensor: torch.Tensor, key: tuple, tracker: SavedTensorTracker) -> None:
        self.tensor = tensor
        self.key = key
        self.tracker = tracker

    def __del__(self) -> None:
        self.tracker._release(self.key)


class SavedTensorTracker:
    """Counts the bytes of live saved activations; keeps the peak and a (time, bytes) trace.

    `exclude(tensors)` names tensors (parameters, buffers) whose storages are never counted.
    Use `with tracker.saving():` around forwards.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._clock = clock
        self._live: dict[tuple, list[int]] = {}  # storage key -> [handles, bytes]
        self._excluded: set[tuple] = set()
        self.current = 0
        self.peak = 0
        self.trace: list[tuple[float, int]] = []

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        self._excluded = {_storage_key(t) for t in tensors}

    def reset_peak(self) -> None:
        self.peak = self.current
        self.trace = [(self._clock(), self.current)]

    def saving(self) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key in self._excluded or tensor.device.type == "meta":
            return tensor
        entry = self._live.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._live[key] = [1, nbytes]
            self._change(nbytes)
        else:
            entry[0] += 1
        # detached: a saved output holding its own grad_fn would make a cycle that keeps the graph alive
        return _Saved(tensor.detach(), key, self)

    def _release(self, key: tuple) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self._change(-entry[1])

    def _change(self, delta: int) -> None:
        if delta == 0:
            return
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current
        self.trace.append((self._clock(), self.current))


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Saved) else packed


def _storage_key(tensor: torch.Tensor) -> tuple:
    storage = tensor.untyped_storage()
    return (tensor.device.type, tensor.device.index, storage.data_ptr(), storage.nbytes())


@dataclass(frozen=True)
class StageMemory:
    """Saved-activation bytes of one microbatch on one stage.

    m_b: saved by F (held until B).  m_w: still held after B until W (split backward).
    """

    m_b: int
    m_w: int

    @property
    def w_ratio(self) -> float:
        return self.m_w / self.m_b if self.m_b else 1.0


def profile_stage_memory(
    stages: Sequence[torch.nn.Module],
    inputs: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    target: torch.Tensor,
) -> tuple[StageMemory, ...]:
    """Run one microbatch through all stages in this process and measure M_B and M_W per stage.

    Uses the runtime's own forward and split backward, so the numbers are what the executor
    holds. Gradients it computes are discarded (parameter `.grad` is left as it was).
    """
    params = [p for stage in stages for p in stage.parameters()]
    before = [None if p.grad is None else p.grad.clone() for p in params]
    tracker = SavedTensorTracker()
    tracker.exclude([*params, *(b for stage in stages for b in stage.buffers())])
    x = inputs
    results = []
    outputs = []
    for index, stage in enumerate(stages):
        if index > 0:
            x = x.detach().requires_grad_(x.is_floating_point())
        start = tracker.current
        with tracker.saving():
            out = stage(x)
            if index == len(stages) - 1:
                out = loss_fn(out, target)
        results.append(tracker.current - start)
        outputs.append((x, out))
        x = out
    grad = None
    kept = []
    for index in reversed(range(len(stages))):
        x, out = outputs[index]
        outputs[index] = None  # drop the graph root, as the executor does after B
        before_b = tracker.current
        dx, work = input_backward(out, grad, x if index > 0 else None, list(stages[index].parameters()))
        del out
        freed = before_b - tracker.current
        kept.append(work)
        results[index] = StageMemory(m_b=results[index], m_w=results[index] - freed)
        grad = dx
    for work in kept:
        work.run()
    for p, g in zip(params, before):
        p.grad = g
    return tuple(results)


def profile_chunk_memory(
    stages: Sequence[torch.nn.Module],
    inputs: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    target: torch.Tensor,
    lengths: Sequence[int],
) -> tuple[float, ...]:
    """Saved bytes of each sequence chunk's forward, summed over the stages, as a fraction of
    one whole microbatch's (`Costs(seq_mem=...)`, with `mem_b` from `profile_stage_memory`).

    Runs the chunks forward in order through all stages in this process, as the runtime
    does (same compute, same K/V cache); the shares need not sum to 1: attention over the
    earlier chunks' keys saves a longer K/V than the whole sequence's attention does per token.
    """
    from .compute import ModuleCompute
    from .sequence import SequenceChunk, chunk_bounds

    params = [p for stage in stages for p in stage.parameters()]
    before = [None if p.grad is None else p.grad.clone() for p in params]
    full = sum(s.m_b for s in profile_stage_memory(stages, inputs, loss_fn, target))
    tracker = SavedTensorTracker()
    tracker.exclude([*params, *(b for stage in stages for b in stage.buffers())])
    last = len(stages) - 1
    # one compute (and K/V cache) per stage, as on separate ranks: masks are not shared across stages
    computes = [ModuleCompute({s: stage}, loss_fn, last, 1, tracker) for s, stage in enumerate(stages)]
    k, total = len(lengths), sum(lengths)
    shares, units = [], []
    for c, (offset, n) in enumerate(chunk_bounds(list(lengths))):
        x = inputs[:, offset:offset + n].clone()
        start = tracker.current
        chain = []
        for s in range(len(stages)):
            chunk = SequenceChunk(s, 0, c, k, offset, n, total)
            out, unit = computes[s].forward(s, x, target[:, offset:offset + n] if s == last else None, chunk=chunk)
            chain.append(unit)
            x = out
        shares.append((tracker.current - start) / full if full else 1.0 / k)
        units.append(chain)
    for chain in reversed(units):  # free the graphs the way the runtime does: backward, LIFO over chunks
        grad = None
        for s in reversed(range(len(stages))):
            grad = computes[s].full_backward(s, chain[s], grad)
    for p, g in zip(params, before):
        p.grad = g
    return tuple(shares)
