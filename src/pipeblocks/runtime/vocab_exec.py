"""One rank's side of the vocabulary passes of a Program (vocabulary parallelism).

A lowered Program with vocabulary parallelism (`core.ir.vocab`, placed by
`core.lowering.vocab_place.add_vocab`) holds IF, S, T and IB ops on every rank beside the stages'
actions. `VocabRank` runs them for one rank with the arithmetic of `vocab_parallel` and
gives the stages what they need from them::

    rank.run(VocabPass("IF", 5))           its rows' embedding of microbatch 5, all-reduced
    rank.embedding_output(5)               stage 0's input for 0F5 (waits for IF5's reduction)
    rank.after_last_forward(5, x)          the last stage's output X: sent to every other rank
    rank.run(VocabPass("S", 5))            X (received) -> logits shard, statistics; C0 issued
    rank.last_output_grad(5)               dL/dX for the last stage's backward (waits for C0)
    rank.run(VocabPass("T", 5))            the head shard's gradient (waits for C0)
    rank.after_first_backward(5, grad)     dL/d(embedding output): sent to every other rank
    rank.run(VocabPass("IB", 5))           the embedding shard's gradient (receives it)

Communication is what `core.lowering.vocab_links` prices and checks: X and the embedding gradient
travel point to point from their root (`VocabLink.send` / `recv`); C0 and IF's reduction
are all-reduces, each kind issued in microbatch order on a worker of its own (the rank's
communication stream for that collective: `VocabLink.issue`), and waited on only where
the result is needed. So a rank never blocks at S or IF for the others, as the simulator
and the deadlock check assume.

The loss of microbatch i (mean cross entropy over its labels, times `scale`, 1/m for the
mean over a step) is known on every rank after C0: `losses()`.

`run` returns the seconds the pass waited for its input (S for X, T for C0's statistics,
IB for the embedding gradient; IF waits for nothing), so that the executor's timeline
counts the wait as idle, as the simulator does. `before_pass`, when given, is called with
the pass once its input is in and before its arithmetic: emulated compute sleeps the
pass's modelled time there (`vocab_emulate`), so that S issues C0 at its end, as priced.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Protocol

from torch import Tensor

from ..core.ir.vocab import VocabPass
from .vocab_parallel import (
    AllReduce, OutputShard, OutputStats, VocabPartition, embedding_forward_local, embedding_weight_grad,
    mean_token_grad, output_forward, output_input_grad, output_weight_grad, reduce_output,
)

__all__ = ["VocabLink", "VocabRank", "VocabTables"]


class VocabLink(Protocol):
    """What a rank's vocabulary passes communicate through."""

    def send(self, tensor: Tensor, dst: int, key: tuple) -> None:
        """Post a point-to-point send (never blocks)."""

    def recv(self, key: tuple) -> Tensor:
        """The tensor sent under `key` to this rank (blocks until it has arrived)."""

    def issue(self, kind: str, work: Callable[[AllReduce], object]) -> Future:
        """Run `work(all_reduce)` on the worker of collective `kind` ("C0" or "IF"), in issue
        order; the future holds its result."""


@dataclass
class VocabTables:
    """This rank's rows of the embedding and of the head (one tensor for both when tied);
    their `.grad` accumulates the passes' gradients."""

    embedding: Tensor
    head: Tensor

    @property
    def tied(self) -> bool:
        return self.embedding is self.head


class VocabRank:
    """The vocabulary passes of rank `rank` (of `part.ranks`) for one step of microbatches
    `tokens[i]` / `labels[i]` (flat [n] each); `first` / `last`: the ranks holding stage 0
    and the last stage; `before_pass`: see the module doc."""

    def __init__(self, rank: int, part: VocabPartition, tables: VocabTables, link: VocabLink, *,
                 tokens: list[Tensor], labels: list[Tensor], first: int, last: int, scale: float = 1.0,
                 timeout: float = 120.0, before_pass: Callable[[VocabPass], None] | None = None) -> None:
        self.rank, self.part, self.tables, self.link = rank, part, tables, link
        self.tokens, self.labels, self.first, self.last = tokens, labels, first, last
        self.scale, self.timeout, self.before_pass = scale, timeout, before_pass
        self._embedded: dict[int, Future] = {}
        self._x: dict[int, Tensor] = {}
        self._demb: dict[int, Tensor] = {}
        self._shard: dict[int, OutputShard] = {}
        self._stats: dict[int, Future] = {}

    def _g(self, i: int, like: Tensor) -> Tensor:
        return mean_token_grad(self.labels[i], scale=self.scale, dtype=like.dtype)

    def run(self, op: VocabPass) -> float:
        """Run pass `op`; the seconds it waited for its input (module doc)."""
        i = op.microbatch
        waited = 0.0
        if op.kind == "IF":
            self._before(op)
            local = embedding_forward_local(self.tokens[i], self.tables.embedding.detach(), self.part, self.rank)

            def reduce(all_reduce: AllReduce, local: Tensor = local) -> Tensor:
                all_reduce(local, "sum")
                return local

            self._embedded[i] = self.link.issue("IF", reduce)
        elif op.kind == "S":
            start = time.perf_counter()
            x = self._x.pop(i) if self.rank == self.last else self.link.recv(("X", i, self.rank))
            waited = time.perf_counter() - start
            self._before(op)
            shard, partials = output_forward(x, self.tables.head, self.labels[i], self.part, self.rank)
            self._shard[i] = shard
            labels = self.labels[i]
            rank, ranks = self.rank, self.part.ranks
            self._stats[i] = self.link.issue(
                "C0", lambda all_reduce: reduce_output(partials, labels, all_reduce, rank=rank, ranks=ranks))
        elif op.kind == "T":
            shard = self._shard.pop(i)
            start = time.perf_counter()
            stats: OutputStats = self._stats[i].result(self.timeout)
            waited = time.perf_counter() - start
            self._before(op)
            _accumulate(self.tables.head, output_weight_grad(shard, stats, self._g(i, shard.softmax),
                                                             dtype=self.tables.head.dtype))
        elif op.kind == "IB":
            start = time.perf_counter()
            grad = self._demb.pop(i) if self.rank == self.first else self.link.recv(("D", i, self.rank))
            waited = time.perf_counter() - start
            self._before(op)
            _accumulate(self.tables.embedding,
                        embedding_weight_grad(self.tokens[i], grad, self.part, self.rank).to(self.tables.embedding.dtype))
        else:
            raise ValueError(f"unknown vocabulary pass {op}: expected IF, S, T or IB")
        return waited

    def _before(self, op: VocabPass) -> None:
        if self.before_pass is not None:
            self.before_pass(op)

    def embedding_output(self, i: int) -> Tensor:
        """Stage 0's input for microbatch i: IF(i)'s all-reduced embedding output."""
        return self._embedded.pop(i).result(self.timeout)

    def after_last_forward(self, i: int, x: Tensor) -> None:
        """The last stage's output X of microbatch i ([n, h]): kept here, sent to every other rank."""
        x = x.detach()
        self._x[i] = x
        for r in range(self.part.ranks):
            if r != self.rank:
                self.link.send(x, r, ("X", i, r))

    def last_output_grad(self, i: int) -> Tensor:
        """dL/dX of microbatch i for the last stage's backward (C0's result)."""
        stats: OutputStats = self._stats[i].result(self.timeout)
        return output_input_grad(stats, self._g(i, stats.input_grad))

    def after_first_backward(self, i: int, grad: Tensor) -> None:
        """dL/d(embedding output) of microbatch i from stage 0's backward: kept, sent to every other rank."""
        grad = grad.detach()
        self._demb[i] = grad
        for r in range(self.part.ranks):
            if r != self.rank:
                self.link.send(grad, r, ("D", i, r))

    def losses(self) -> list[Tensor]:
        """Per microbatch, scale × the mean token loss (from C0, on every rank)."""
        out = []
        for i in sorted(self._stats):
            stats: OutputStats = self._stats[i].result(self.timeout)
            valid = stats.valid
            out.append(stats.token_loss().sum() * self.scale / max(int(valid.sum()), 1))
        return out


def _accumulate(param: Tensor, grad: Tensor) -> None:
    if param.grad is None:
        param.grad = grad.clone()
    else:
        param.grad += grad
