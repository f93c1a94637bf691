"""The vocabulary passes' communication on torch.distributed (`vocab_exec.VocabLink`).

X and the embedding output's gradient go point to point (`isend` / `irecv`, tagged by
microbatch above the pipeline's own tags); C0 and IF's reduction run on a process group of
their own each, issued from one worker thread per group, so they keep their microbatch
order on every rank and never wait behind the rank's compute::

    link = DistVocabLink([0, 1, 2, 3], (n, h), torch.float64, first=0, last=0)  # every rank calls it
    rank = VocabRank(dist.get_rank(), part, tables, link, ...)
    ...
    link.close()                                                          # the step's sends done

`ranks` are the global ranks of one pipeline, in pipeline order; `first` and `last` the
pipeline ranks holding stage 0 and the last stage (the roots of D and X). Every process of
the job must construct the link for every pipeline in the same order (`new_group` is
collective).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .vocab_parallel import AllReduce, process_group_all_reduce

__all__ = ["DistVocabLink", "VOCAB_TAG_BASE"]

VOCAB_TAG_BASE = 1 << 24
"""Tags of the vocabulary transfers start here, above any pipeline transfer's."""

_KINDS = ("C0", "IF")


class DistVocabLink:
    """One rank's `VocabLink` over the pipeline of global `ranks`; received tensors are
    `shape` of `dtype` (X and the embedding gradient: n tokens x h)."""

    def __init__(self, ranks: Sequence[int], shape: tuple[int, ...], dtype: torch.dtype, *, first: int, last: int,
                 device: torch.device | str = "cpu") -> None:
        self.ranks = list(ranks)
        self.roots = {"X": self.ranks[last], "D": self.ranks[first]}
        self.shape, self.dtype, self.device = tuple(shape), dtype, torch.device(device)
        self.groups = {kind: dist.new_group(self.ranks) for kind in _KINDS}
        self.workers = {kind: ThreadPoolExecutor(1, thread_name_prefix=f"vocab-{kind}") for kind in _KINDS}
        self.sends: list = []

    def _tag(self, key: tuple) -> int:
        kind, microbatch = key[0], key[1]
        return VOCAB_TAG_BASE + 2 * microbatch + (0 if kind == "X" else 1)

    def send(self, tensor: Tensor, dst: int, key: tuple) -> None:
        self.sends.append(dist.isend(tensor.contiguous(), dst=self.ranks[dst], tag=self._tag(key)))

    def recv(self, key: tuple) -> Tensor:
        kind = key[0]
        if kind not in ("X", "D"):
            raise ValueError(f"vocabulary transfer {key}: only X and the embedding gradient (D) travel point to point")
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(out, src=self.roots[kind], tag=self._tag(key))  # X from the last stage's rank, D from stage 0's
        return out

    def issue(self, kind: str, work: Callable[[AllReduce], object]) -> Future:
        return self.workers[kind].submit(work, process_group_all_reduce(self.groups[kind]))

    def finish_step(self) -> None:
        """Wait for this rank's sends of the step (the workers stay, for the next step)."""
        for handle in self.sends:
            handle.wait()
        self.sends.clear()

    def close(self) -> None:
        """Wait for this rank's sends; stop the workers."""
        self.finish_step()
        for worker in self.workers.values():
            worker.shutdown(wait=True)
