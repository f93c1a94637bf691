"""The vocabulary passes inside a training step: what the executor asks of them.

Under vocabulary parallelism (`core.ir.vocab`) the stages hold no embedding and no head:
stage 0 takes the all-reduced embedding output, the last stage ends at the final norm's
output X, and every rank holds 1/p of the rows of both tables (one shard when tied). A
1F1B rank of p = 2 runs, for microbatch 5::

    IF5    rank's rows of the embedding, all-reduced   -> stage 0's input of 0F5
    1F5    ... the last stage's output X               -> sent to every rank
    S5     logits shard, statistics, C0 issued
    1B5    dL/dX from C0                               -> the last stage's backward
    T5     the head shard's gradient
    0B5    dL/d(embedding output)                      -> sent to every rank
    IB5    the embedding shard's gradient

`VocabStep` wraps `vocab_exec.VocabRank` for the executor: it reshapes between the stages'
[b, s, h] activations and the passes' flat [n, h], starts a `VocabRank` each step on the
step's token ids and labels (every rank needs both), and gives the step's losses, which
every rank knows after C0. The tables are `nn.Parameter`s that the optimizer steps; their
gradients accumulate in `.grad` as any parameter's.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..core.ir.vocab import VocabPass
from .vocab_exec import VocabLink, VocabRank, VocabTables
from .vocab_parallel import VocabPartition

__all__ = ["VocabStep"]


class VocabStep:
    """Rank `rank`'s vocabulary passes: `embedding` and `head` are its row shards
    ([ceil(V/p), h] each; the same parameter when tied); `first` / `last`: the pipeline
    ranks holding stage 0 and the last stage; `dtype`: what stage 0 takes as input;
    `before_pass`: called with each pass once its input is in, before its arithmetic
    (emulated compute sleeps there: `vocab_emulate`)."""

    def __init__(self, rank: int, part: VocabPartition, embedding: nn.Parameter, head: nn.Parameter, link: VocabLink,
                 *, first: int, last: int, dtype: torch.dtype, timeout_s: float = 300.0,
                 before_pass: Callable[[VocabPass], None] | None = None) -> None:
        self.rank, self.part, self.link, self.before_pass = rank, part, link, before_pass
        self.tables = VocabTables(embedding, head)
        self.first, self.last, self.dtype, self.timeout_s = first, last, dtype, timeout_s
        self.hidden = embedding.shape[1]
        self._rank: VocabRank | None = None
        self._shape: tuple[int, ...] = ()

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The rank's table shards (one when tied)."""
        return [self.tables.embedding] if self.tables.tied else [self.tables.embedding, self.tables.head]

    def stage_input(self, tokens: Tensor) -> Tensor:
        """An (empty) stage-0 input of a microbatch of `tokens` [b, s]: for the shape pass."""
        return torch.empty(*tokens.shape, self.hidden, dtype=self.dtype, device=tokens.device)

    def begin_step(self, tokens: Sequence[Tensor], labels: Sequence[Tensor]) -> None:
        """The step's m microbatches of token ids and labels ([b, s] each)."""
        m = len(tokens)
        self._shape = tuple(tokens[0].shape)
        self._rank = VocabRank(self.rank, self.part, self.tables, self.link,
                               tokens=[t.reshape(-1) for t in tokens], labels=[y.reshape(-1) for y in labels],
                               first=self.first, last=self.last, scale=1.0 / m, timeout=self.timeout_s,
                               before_pass=self.before_pass)

    def run(self, op: VocabPass) -> float:
        """Run pass `op`; the seconds it waited for its input (X, C0's statistics, the embedding gradient)."""
        with torch.no_grad():  # the passes compute their gradients themselves
            return self._rank.run(op)

    def embedding_output(self, i: int) -> Tensor:
        return self._rank.embedding_output(i).view(*self._shape, self.hidden).to(self.dtype)

    def after_last_forward(self, i: int, x: Tensor) -> None:
        self._rank.after_last_forward(i, x.detach().reshape(-1, self.hidden))

    def last_output_grad(self, i: int) -> Tensor:
        return self._rank.last_output_grad(i).view(*self._shape, self.hidden)

    def after_first_backward(self, i: int, grad: Tensor) -> None:
        self._rank.after_first_backward(i, grad.reshape(-1, self.hidden))

    def reduce_gradients(self, group, replicas: int) -> None:
        """Data parallelism: the rows' gradients averaged over the `replicas` of the dp `group`
        (the same rows on every replica, as any replicated parameter's)."""
        for table in self.parameters:
            if table.grad is None:
                table.grad = torch.zeros_like(table)
            dist.all_reduce(table.grad, group=group)
            table.grad.div_(replicas)

    def end_step(self) -> tuple[float, ...]:
        """Per microbatch, the mean token loss (every rank: C0 gave it); this rank's sends done."""
        losses = tuple(float(loss) * len(self._rank.tokens) for loss in self._rank.losses())
        finish = getattr(self.link, "finish_step", None)
        if finish is not None:
            finish()
        self._rank = None
        return losses
