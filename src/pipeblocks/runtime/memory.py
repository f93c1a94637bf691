"""Measured saved-activation memory: what autograd keeps for the backward, per rank.

`SavedTensorTracker` wraps forwards in `saved_tensors_hooks`. Every tensor autograd saves
is packed into a small handle; the handle counts the tensor's *storage* once (views and
repeated saves of one storage count once) and uncounts it when the last handle of that
storage is freed, which happens when the graph releases its saved tensors (after a fused
backward, after W, or when the graph is dropped). Parameters and buffers are not
activations and are not counted. Tensors the executor holds outside the graph (the
stage output until its backward, received gradients, send buffers) are not counted
either: the number is autograd's saved-activation footprint, the quantity the
simulator's memory model (README, Definitions) predicts. The one exception is the input a
recomputed forward keeps in place of its graph (`hold`): the simulator counts it, so it
is counted here too.

Profiling one microbatch through stage modules with this tracker (M_B, M_W per stage, a
sequence chunk's share) lives in `profile.py`, which builds on the compute passes.
"""
from __future__ import annotations

import contextlib

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["SavedTensorTracker", "StageMemory"]


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

    def also_exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Exclude more storages (parameters gathered during the step: they are not activations)."""
        self._excluded |= {_storage_key(t) for t in tensors}

    def reset_peak(self) -> None:
        self.peak = self.current
        self.trace = [(self._clock(), self.current)]

    def saving(self) -> contextlib.AbstractContextManager:
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def hold(self, tensor: torch.Tensor) -> object | None:
        """Count `tensor` as a saved activation while the returned handle lives (the input a
        recomputed forward keeps outside any graph); None when not measuring."""
        if not self.enabled:
            return None
        packed = self._pack(tensor)
        return packed if isinstance(packed, _Saved) else None

    def _pack(self, tensor: torch.Tensor):
        key = _storage_key(tensor)
        if key in self._excluded or tensor.device.type == "meta":
            return tensor
        entry = self._live.get(key)
        if entry is None:
            nbytes = _plain(tensor).untyped_storage().nbytes()
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


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the memory: a DTensor's local shard, the result buffer of an
    asynchronous collective (tensor subclasses that wrap one inner tensor)."""
    while is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, names[0])
    return tensor


def _storage_key(tensor: torch.Tensor) -> tuple:
    tensor = _plain(tensor)
    storage = tensor.untyped_storage()
    return (tensor.device.type, tensor.device.index, storage.data_ptr(), storage.nbytes())


@dataclass(frozen=True)
class StageMemory:
    """Saved-activation bytes of one microbatch on one stage.

    m_b: saved by F (held until B).  m_w: still held after B until W (split backward).
    m_in: the stage input's bytes, what a recomputed F keeps in place of m_b
        (`Costs(recompute_input_ratio=m_in / m_b)`).
    """

    m_b: int
    m_w: int
    m_in: int = 0

    @property
    def input_ratio(self) -> float:
        return min(1.0, self.m_in / self.m_b) if self.m_b else 1.0

    @property
    def w_ratio(self) -> float:
        return self.m_w / self.m_b if self.m_b else 1.0
