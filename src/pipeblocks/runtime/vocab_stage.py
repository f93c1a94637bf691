"""One pipeline rank's share of the vocabulary layers, and its four passes per microbatch.

With vocabulary parallelism (docs/vocab-parallel.md) every pipeline rank holds rows
``[r·s, (r+1)·s)`` of the input embedding and of the head (one table when they are tied) and,
per microbatch, runs the passes below in the order the schedule gives them. The arithmetic is
`runtime.vocab_parallel`'s; this module keeps the parameters, the collectives' roots and the
state a pass leaves for a later one::

    stage = VocabStage.from_tables(embed.weight, head.weight, part, rank, first_rank=0, last_rank=3,
                                   all_reduce=process_group_all_reduce(pp_group),
                                   broadcast=process_group_broadcast(pp_group))
    h0 = stage.input_forward(5, tokens)          # IF5: every rank; stage 0's rank feeds h0 to 0F5
    stage.output_forward(5, x, labels)           # S5 + C0: x given on last_rank (its 3F5 output), None elsewhere
    loss = stage.loss(5)                         # the microbatch's mean cross entropy, on every rank
    dx = stage.output_input_grad(5, scale)       # on last_rank: the output gradient its 3B5 takes
    stage.output_backward(5, scale)              # T5: the head rows' gradient, into .grad
    stage.input_backward(5, dh0)                 # IB5: dh0 given on first_rank (0B5's input gradient), None elsewhere

`scale` is the weight of this microbatch's mean loss in the step's loss (1/m for a mean over
microbatches). Gradients accumulate into the shards' ``.grad`` as autograd would, so the
optimizer and data parallelism treat `parameters()` like any other stage's. The collectives are
callables: `process_group_all_reduce` and `process_group_broadcast` wrap torch.distributed, and a
caller may route them to its own communication stream. Every rank of the pipeline group must call
the passes in the same order (they hold collectives).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from .vocab_parallel import (
    IGNORE_INDEX, AllReduce, OutputShard, OutputStats, VocabPartition, embedding_forward, embedding_weight_grad,
    mean_token_grad, output_forward, output_input_grad, output_weight_grad, reduce_output, shard_rows,
)

__all__ = ["Broadcast", "VocabStage", "process_group_broadcast"]

Broadcast = Callable[[Tensor, int], None]
"""sends a tensor in place from pipeline rank `src` (its index in the group) to every rank of the group"""


def process_group_broadcast(group=None) -> Broadcast:
    """A `Broadcast` over a torch.distributed group (None: the default group), `src` a group rank."""
    import torch.distributed as dist

    def broadcast(tensor: Tensor, src: int) -> None:
        dist.broadcast(tensor, dist.get_global_rank(group, src) if group is not None else src, group=group)

    return broadcast


@dataclass
class _Output:
    """What S leaves for T (and the loss) of one microbatch."""

    shard: OutputShard
    stats: OutputStats
    labels: Tensor
    shape: torch.Size
    """the last stage's output shape (the input gradient is returned in it)"""


class VocabStage(nn.Module):
    """This rank's rows of the input embedding and of the head (`embedding` alone when tied)."""

    def __init__(self, part: VocabPartition, rank: int, *, embedding: nn.Parameter, head: nn.Parameter | None,
                 first_rank: int, last_rank: int, all_reduce: AllReduce, broadcast: Broadcast,
                 activation_dtype: torch.dtype | None = None, ignore_index: int = IGNORE_INDEX) -> None:
        super().__init__()
        if not 0 <= rank < part.ranks:
            raise ValueError(f"rank {rank} is outside the vocabulary split over p = {part.ranks} ranks")
        for name, table in (("embedding", embedding), ("head", head)):
            if table is not None and table.shape[0] != part.shard_size:
                raise ValueError(f"the {name} shard has {table.shape[0]} rows, the split gives each rank "
                                 f"{part.shard_size} (V = {part.vocab_size}, p = {part.ranks})")
        self.part, self.rank = part, rank
        self.first_rank, self.last_rank = first_rank, last_rank
        self.embedding = embedding
        self.head = head
        self._all_reduce, self._broadcast = all_reduce, broadcast
        self.activation_dtype = activation_dtype or embedding.dtype
        self.ignore_index = ignore_index
        self._tokens: dict[int, Tensor] = {}
        self._outputs: dict[int, _Output] = {}

    @classmethod
    def from_tables(cls, embedding: Tensor, head: Tensor | None, part: VocabPartition, rank: int,
                    **kwargs) -> VocabStage:
        """The stage holding `rank`'s rows of the whole [V, h] tables (`head` None: tied to the embedding)."""
        emb = nn.Parameter(shard_rows(embedding.detach(), part, rank))
        out = None if head is None else nn.Parameter(shard_rows(head.detach(), part, rank))
        return cls(part, rank, embedding=emb, head=out, **kwargs)

    @property
    def tied(self) -> bool:
        return self.head is None

    def _head(self) -> nn.Parameter:
        return self.embedding if self.head is None else self.head

    def pending(self) -> tuple[list[int], list[int]]:
        """The microbatches whose IB, and whose T, have not run yet (state still held)."""
        return sorted(self._tokens), sorted(self._outputs)

    # the input embedding

    def input_forward(self, mb: int, tokens: Tensor) -> Tensor:
        """IF: the embedding output of `tokens` ([b, s] ids), the same on every rank (detached)."""
        self._tokens[mb] = tokens
        out = embedding_forward(tokens, self.embedding.to(self.activation_dtype), self.part, self.rank,
                                self._all_reduce)
        return out

    def input_backward(self, mb: int, grad: Tensor | None) -> None:
        """IB: `grad` = dL/d(embedding output), given on the first stage's rank (None elsewhere)."""
        tokens = self._tokens.pop(mb)
        if self.rank == self.first_rank:
            if grad is None:
                raise ValueError(f"IB{mb} on rank {self.rank}, the first stage's: give the embedding output's gradient")
            buffer = grad.detach().to(self.activation_dtype).contiguous()
        else:
            buffer = torch.empty((*tokens.shape, self.embedding.shape[1]), dtype=self.activation_dtype,
                                 device=self.embedding.device)
        self._broadcast(buffer, self.first_rank)
        _accumulate(self.embedding, embedding_weight_grad(tokens, buffer, self.part, self.rank))

    # the output layer

    def output_forward(self, mb: int, x: Tensor | None, labels: Tensor) -> None:
        """S and C0: `x` is the last stage's output ([b, s, h]) on its rank, None elsewhere; `labels` [b, s]."""
        flat = labels.reshape(-1)
        h = self.embedding.shape[1]
        if self.rank == self.last_rank:
            if x is None:
                raise ValueError(f"S{mb} on rank {self.rank}, the last stage's: give its output")
            shape = x.shape
            # a copy: the broadcast writes its tensor (version counter), and autograd may have saved x
            buffer = x.detach().reshape(-1, h).to(self.activation_dtype, copy=True)
        else:
            shape = torch.Size((*labels.shape, h))
            buffer = torch.empty((flat.numel(), h), dtype=self.activation_dtype, device=self.embedding.device)
        self._broadcast(buffer, self.last_rank)
        head = self._head().to(self.activation_dtype)
        shard, partials = output_forward(buffer, head, flat, self.part, self.rank, ignore_index=self.ignore_index)
        stats = reduce_output(partials, flat, self._all_reduce, ignore_index=self.ignore_index)
        self._outputs[mb] = _Output(shard, stats, flat, shape)

    def _grad_tokens(self, out: _Output, scale: float) -> Tensor:
        return mean_token_grad(out.labels, ignore_index=self.ignore_index, scale=scale, dtype=out.stats.sum_exp.dtype)

    def loss(self, mb: int) -> Tensor:
        """The microbatch's mean cross entropy over its counted labels (on every rank, after S)."""
        out = self._outputs[mb]
        return (out.stats.token_loss() * self._grad_tokens(out, 1.0)).sum()

    def output_input_grad(self, mb: int, scale: float) -> Tensor:
        """dL/dX in the last stage's output shape and dtype, L = scale × the microbatch's mean loss."""
        out = self._outputs[mb]
        grad = output_input_grad(out.stats, self._grad_tokens(out, scale), dtype=self.activation_dtype)
        return grad.reshape(out.shape)

    def output_backward(self, mb: int, scale: float) -> None:
        """T: the head rows' gradient for L = scale × the microbatch's mean loss; frees S's state."""
        out = self._outputs.pop(mb)
        head = self._head()
        _accumulate(head, output_weight_grad(out.shard, out.stats, self._grad_tokens(out, scale), dtype=head.dtype))

    # the whole tables, for checkpoints and export

    def gather_tables(self) -> tuple[Tensor, Tensor | None]:
        """The [V, h] embedding and head (None when tied) on every rank: each rank's rows summed
        into zeros elsewhere (exact in any dtype), padding dropped."""
        tables = []
        for table in (self.embedding, self.head):
            if table is None:
                tables.append(None)
                continue
            full = table.new_zeros((self.part.padded_size, table.shape[1]))
            start = self.part.start(self.rank)
            full[start:start + self.part.shard_size] = table.detach()
            self._all_reduce(full, "sum")
            tables.append(full[: self.part.vocab_size])
        return tables[0], tables[1]


def _accumulate(param: nn.Parameter, grad: Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
