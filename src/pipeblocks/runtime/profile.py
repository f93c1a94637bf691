"""Profiling stage modules on one microbatch in one process: what the simulator needs.

`profile_stage_memory` measures, per stage, what F saves (M_B), what B keeps for W
(M_W) and the input a recomputed F keeps, to feed `Costs(mem_b=..., mem_w_ratio=...,
recompute_input_ratio=...)`. `profile_chunk_memory` measures, for a
sequence-chunk schedule, what each chunk saves relative to the whole microbatch (chunk 0
with the microbatch's K/V buffer), to feed `Costs(seq_mem=...)`. `profile_stage_times` times F, B and W per
stage, to predict an iteration before launching one. All use the runtime's own forward
and split backward, so the numbers are what the executor does.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch

from .backward import PartitionCache, input_backward
from .compute import ModuleCompute
from .memory import SavedTensorTracker, StageMemory
from .sequence import SequenceChunk, chunk_bounds

__all__ = ["grads_kept", "measure_passes", "profile_stage_memory", "profile_chunk_memory", "profile_stage_times"]


def profile_stage_memory(
    stages: Sequence[torch.nn.Module],
    inputs: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    target: torch.Tensor,
) -> tuple[StageMemory, ...]:
    """Run one microbatch through all stages in this process and measure M_B and M_W per stage,
    as the executor holds them (module doc); parameter `.grad` is left as it was."""
    with grads_kept(stages) as params:
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
            results.append((tracker.current - start, x.numel() * x.element_size()))
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
            m_b, m_in = results[index]
            results[index] = StageMemory(m_b=m_b, m_w=m_b - freed, m_in=m_in)
            grad = dx
        for work in kept:
            work.run()
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
    does (same compute, same K/V cache). Chunk 0 allocates the K/V buffer of the whole
    sequence, so its share carries every token's K and V; the buffer is freed with chunk 0's
    backward, the microbatch's last, which is where the simulator frees chunk 0's share.
    """

    with grads_kept(stages) as params:
        full = sum(s.m_b for s in profile_stage_memory(stages, inputs, loss_fn, target))
        tracker = SavedTensorTracker()
        tracker.exclude([*params, *(b for stage in stages for b in stage.buffers())])
        last = len(stages) - 1
        # one compute (and K/V cache) per stage, as on separate ranks
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
    return tuple(shares)


def profile_stage_times(
    stages: Sequence[torch.nn.Module],
    inputs: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    target: torch.Tensor,
    *,
    repeats: int = 3,
    clock: Callable[[], float] = time.perf_counter,
    reduce: Callable[[list[float]], float] = statistics.median,
) -> tuple[tuple[float, float, float], ...]:
    """Per stage, the (F, B, W) seconds of one microbatch: the median (or `reduce`) of
    `repeats` runs after one warm-up run, which also finds each stage's B/W partition,
    reused by the timed runs as the runtime reuses it (`backward.PartitionCache`).
    Parameter `.grad` is left as it was."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    partitions = [PartitionCache() for _ in stages]
    with grads_kept(stages):
        runs = [measure_passes(stages, inputs, loss_fn, target, partial(_Stopwatch, clock), partitions=partitions)
                for _ in range(repeats + 1)]
    timed = runs[1:]  # the first run warms up allocators and kernels
    return tuple(
        tuple(reduce([run[s][i].value for run in timed]) for i in range(3)) for s in range(len(stages))
    )


def measure_passes(
    stages: Sequence[torch.nn.Module], inputs: torch.Tensor, loss_fn: Callable, target: torch.Tensor,
    meter: Callable[[], Any], *, partitions: Sequence[PartitionCache] | None = None,
) -> list[tuple[Any, Any, Any]]:
    """One microbatch through all `stages` in this process with the runtime's own forward and
    split backward, each stage's F, B and W inside a fresh `meter()` (a context manager):
    per stage, its three meters (stage 0: B does nothing, W runs the whole backward)."""
    x, outputs, forward = inputs, [], []
    for index, stage in enumerate(stages):
        if index > 0:
            x = x.detach().requires_grad_(x.is_floating_point())
        with meter() as f:
            out = stage(x)
            if index == len(stages) - 1:
                out = loss_fn(out, target)
        forward.append(f)
        outputs.append((x, out))
        x = out
    grad, meters = None, [None] * len(stages)
    for index in reversed(range(len(stages))):
        x, out = outputs[index]
        with meter() as b:
            dx, work = input_backward(out, grad, x if index > 0 else None, list(stages[index].parameters()),
                                      partitions=None if partitions is None else partitions[index])
        with meter() as w:
            work.run()
        meters[index] = (forward[index], b, w)
        grad = dx
    return meters


@contextlib.contextmanager
def grads_kept(stages: Sequence[torch.nn.Module]) -> Iterator[list[torch.nn.Parameter]]:
    """The stages' parameters; their `.grad` is put back as it was when the block ends."""
    params = [p for stage in stages for p in stage.parameters()]
    before = [None if p.grad is None else p.grad.clone() for p in params]
    yield params
    for p, g in zip(params, before):
        p.grad = g


class _Stopwatch:
    """A pass's seconds by `clock` (`value`, once the pass is done)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def __enter__(self) -> _Stopwatch:
        self.start = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        self.value = self.clock() - self.start
