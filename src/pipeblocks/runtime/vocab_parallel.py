"""Vocabulary parallelism numerics: the output layer and the input embedding split by vocabulary rows.

Vocabulary Parallelism (Yeung, Qi, Lin, Wan, MLSys 2025) spreads the head (with its softmax
cross entropy) and the input embedding over all p pipeline ranks: rank r holds the rows
``[r·s, (r+1)·s)`` of both tables, ``s = ceil(V/p)``. This module is the arithmetic of that
split, pure torch and without any scheduling; the schedule decides *when* each pass runs
(docs/vocab-parallel.md), this module says *what* it computes. Per microbatch, with X the last
stage's output (n tokens × h) sent to every rank and y the labels:

    S   (every rank)  Z_r = X·W_rᵀ, its local max m_r, local sum e_r = Σ exp(Z_r − m_r), the
                      target logit t_r (0 where y is not in r's rows), the local softmax P̃_r,
                      G_r = P̃_r·W_r and Y_r = W_r[y]                      -> output_forward
    C0  (one barrier) every rank's (m_r, e_r, t_r) gathered; M = max m_r; E = Σ e_r·exp(m_r − M);
                      z = Σ t_r; dX/g = Σ (α_r·G_r − Y_r), α_r = e_r·exp(m_r − M)/E
                                                                          -> reduce_output
                      loss per token: ℓ = log E + M − z                   -> OutputStats.token_loss
    T   (every rank)  D_r = g ⊙ (α_r·P̃_r − onehot_r(y)); ∇W_r = D_rᵀ·X   -> output_weight_grad
    last stage        dL/dX = g ⊙ dX/g                                    -> output_input_grad
    IF  (every rank)  its rows' lookup (zeros elsewhere), then a SUM all-reduce -> embedding_forward
    IB  (every rank)  the first stage's dL/d(embedding output) sent to all; each rank adds its
                      rows' gradient                                      -> embedding_weight_grad

This is the paper's Algorithm 2: one communication phase C0 between S and T, so the 1F1B
activation overhead is one extra microbatch. It is exact, not an approximation: each rank
normalises with its own max and C0 rescales by exp(m_r − M), so no exponential is recomputed
after the global max is known, and because dX is linear in G_r and Y_r, the all-reduce of
α_r·G_r − Y_r gives Σ_r D_r·W_r / g exactly (Algorithm 1 would need a second barrier C1 after T
to all-reduce D_r·W_r). C0 is two all-reduces issued back to back on the communication stream,
no compute pass between them. The first gathers every rank's statistics: a MAX all-reduce of a
[p, 3, n] buffer in which rank r fills row r with (m_r, e_r, t_r) and every other row with −∞,
so each rank then holds all p rows and computes M, E and z itself, in the same order on every
rank. The second is the SUM of α_r·G_r − Y_r (n·h values), which needs E, known by then. Two
latency-bound rounds, and the bytes of the sums alone: the n·h sum is the one that counts
(3·p·n values gathered is small beside it).

Tied embeddings: the embedding and the head are one table, so a rank holds one shard for both
and adds the T gradient and the IB gradient into it; no pair of copies is kept equal.

Padding: when p does not divide V, the last ranks' shards end in zero rows (``padding`` of them
in all); their logits are masked out, so their gradient is exactly zero. `VocabPartition.note`
says so once; a split that would leave a rank without a real row is refused.

Collectives are passed in, as an `AllReduce` callable ``(tensor, op) -> None`` that reduces in
place over the p ranks (op "sum" or "max"): `process_group_all_reduce(group)` wraps
torch.distributed; tests simulate p shards in one process with threads.

Precision: the matrix products run in the activations' dtype, the run's compute dtype
(bfloat16 under bf16-mixed, where the tables are float32 masters: a shard is rounded to
bfloat16 for its products, as the unsplit head's compute copy is), and everything after them
in float32 or wider: the logits are upcast before the softmax, as the loss upcasts them on one rank; float64 stays float64 throughout. Gradients
come back in the dtype asked for (the parameter's or the activation's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.cost.vocab_partition import VocabPartition, partition_vocab

__all__ = [
    "AllReduce", "VocabPartition", "partition_vocab", "shard_rows", "gather_rows",
    "OutputShard", "OutputPartials", "OutputStats", "output_forward", "reduce_output",
    "output_weight_grad", "output_input_grad", "mean_token_grad",
    "embedding_forward_local", "embedding_forward", "embedding_weight_grad",
    "process_group_all_reduce", "IGNORE_INDEX",
]

IGNORE_INDEX = -100
"""a label that takes no part in the loss (torch's cross_entropy default)"""

AllReduce = Callable[[Tensor, str], None]
"""reduces a tensor in place over the p vocabulary ranks; op is "sum" or "max"."""


def shard_rows(weight: Tensor, part: VocabPartition, rank: int) -> Tensor:
    """Rank `rank`'s [shard_size, h] block of a [V, h] table (a copy; padding rows are zero)."""
    if weight.shape[0] != part.vocab_size:
        raise ValueError(f"the table has {weight.shape[0]} rows but the partition is of V = {part.vocab_size}")
    lo, hi = part.rows(rank)
    out = weight.new_zeros((part.shard_size, *weight.shape[1:]))
    out[: hi - lo] = weight[lo:hi]
    return out


def gather_rows(shards: Sequence[Tensor], part: VocabPartition) -> Tensor:
    """The [V, h] table back from the p shards (padding dropped): for checkpoints and export."""
    if len(shards) != part.ranks:
        raise ValueError(f"{len(shards)} shards given for a partition over p = {part.ranks} ranks")
    return torch.cat([s[: part.real_rows(r)] for r, s in enumerate(shards)], dim=0)


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32, or the dtype itself when wider: what the softmax and its statistics run in"""
    return dtype if torch.finfo(dtype).bits > 32 else torch.float32


@dataclass(frozen=True)
class OutputShard:
    """What pass S keeps on a rank until its pass T (the S -> T state): n·h + n·shard_size values."""

    x: Tensor
    """[n, h] the last stage's output, in the matrix products' dtype"""
    softmax: Tensor
    """[n, shard_size] the local softmax P̃_r = exp(Z_r − m_r)/e_r (0 on padding columns)"""
    local_max: Tensor
    """[n] m_r"""
    local_sum: Tensor
    """[n] e_r"""
    target_column: Tensor
    """[n] the label's column in this shard, -1 where the label is elsewhere or ignored"""


@dataclass(frozen=True)
class OutputPartials:
    """What pass S hands to the barrier C0 (each is summed or maxed over the ranks)."""

    local_max: Tensor
    local_sum: Tensor
    target_logit: Tensor
    """[n] Z_r[y] where y is in r's rows, else 0"""
    softmax_input_grad: Tensor
    """[n, h] G_r = P̃_r·W_r"""
    target_rows: Tensor
    """[n, h] Y_r = W_r[y] where y is in r's rows, else 0"""


@dataclass(frozen=True)
class OutputStats:
    """The result of C0, the same on every rank."""

    global_max: Tensor
    """[n] M"""
    sum_exp: Tensor
    """[n] E = Σ_r e_r·exp(m_r − M)"""
    target_logit: Tensor
    """[n] Z[y] (0 for an ignored label)"""
    input_grad: Tensor
    """[n, h] dL/dX per unit of token gradient: Σ_r (α_r·G_r − Y_r)"""
    valid: Tensor
    """[n] bool, the labels that count"""

    def token_loss(self) -> Tensor:
        """[n] ℓ = log E + M − Z[y] (0 for an ignored label)"""
        loss = torch.log(self.sum_exp) + self.global_max - self.target_logit
        return torch.where(self.valid, loss, torch.zeros_like(loss))


def output_forward(x: Tensor, weight_shard: Tensor, labels: Tensor, part: VocabPartition, rank: int, *,
                   ignore_index: int = IGNORE_INDEX) -> tuple[OutputShard, OutputPartials]:
    """Pass S on `rank`: x [n, h], its head shard [shard_size, h], labels [n] (global ids)."""
    if x.dim() != 2 or labels.shape != x.shape[:1]:
        raise ValueError(f"output_forward takes x [n, h] and labels [n]; got {tuple(x.shape)} and "
                         f"{tuple(labels.shape)} (flatten batch and sequence first)")
    if weight_shard.shape != (part.shard_size, x.shape[1]):
        raise ValueError(f"rank {rank}'s head shard is {tuple(weight_shard.shape)}, expected "
                         f"({part.shard_size}, {x.shape[1]}) for V = {part.vocab_size} over p = {part.ranks}")
    gemm = x.dtype  # the compute dtype: a float32 master shard is rounded as the unsplit head's copy is
    wide = _wide(gemm)
    xc, w = x.detach().to(gemm), weight_shard.detach().to(gemm)
    logits = (xc @ w.T).to(wide)
    real = part.real_rows(rank)
    if real < part.shard_size:
        logits[:, real:] = -math.inf
    local_max = logits.max(dim=1).values
    softmax = torch.exp(logits - local_max[:, None])
    local_sum = softmax.sum(dim=1)
    softmax /= local_sum[:, None]
    lo = part.start(rank)
    column = labels - lo
    mine = (labels != ignore_index) & (column >= 0) & (column < real)
    column = torch.where(mine, column, torch.full_like(column, -1))
    safe = column.clamp(min=0)
    target_logit = torch.where(mine, logits.gather(1, safe[:, None])[:, 0], torch.zeros_like(local_max))
    target_rows = w[safe].to(wide) * mine[:, None].to(wide)
    shard = OutputShard(x=xc, softmax=softmax, local_max=local_max, local_sum=local_sum, target_column=column)
    partials = OutputPartials(local_max=local_max, local_sum=local_sum, target_logit=target_logit,
                              softmax_input_grad=(softmax.to(gemm) @ w).to(wide),
                              target_rows=target_rows)
    return shard, partials


def reduce_output(partials: OutputPartials, labels: Tensor, all_reduce: AllReduce, *, rank: int, ranks: int,
                  ignore_index: int = IGNORE_INDEX) -> OutputStats:
    """Barrier C0 on `rank` of `ranks`: two all-reduces back to back (the module docstring), a
    MAX that gathers every rank's (m_r, e_r, t_r), then the SUM of α_r·G_r − Y_r; the same
    result on every rank."""
    if not 0 <= rank < ranks:
        raise ValueError(f"C0 on rank {rank} of {ranks}: give 0 <= rank < ranks")
    stats = (partials.local_max, partials.local_sum, partials.target_logit)
    gathered = torch.full((ranks, 3, stats[0].shape[0]), -math.inf, dtype=stats[0].dtype, device=stats[0].device)
    gathered[rank] = torch.stack(stats)
    all_reduce(gathered, "max")
    maxima, sums, targets = gathered.unbind(1)  # [p, n] each, every rank's row filled in
    global_max = maxima.max(dim=0).values
    scaled = sums * torch.exp(maxima - global_max)  # s_r, every rank's, in rank order
    sum_exp = scaled.sum(dim=0)
    target_logit = targets.sum(dim=0)
    alpha = scaled[rank] / sum_exp
    input_grad = alpha[:, None] * partials.softmax_input_grad - partials.target_rows
    all_reduce(input_grad, "sum")
    return OutputStats(global_max=global_max, sum_exp=sum_exp, target_logit=target_logit,
                       input_grad=input_grad, valid=labels != ignore_index)


def _token_grad(grad_tokens: Tensor | float, n: int, like: Tensor) -> Tensor:
    g = torch.as_tensor(grad_tokens, dtype=like.dtype, device=like.device)
    return g.expand(n) if g.dim() == 0 else g


def output_weight_grad(shard: OutputShard, stats: OutputStats, grad_tokens: Tensor | float,
                       dtype: torch.dtype | None = None) -> Tensor:
    """Pass T: this rank's head-shard gradient ∇W_r = D_rᵀ·X, D_r = g ⊙ (α_r·P̃_r − onehot_r(y)).

    grad_tokens is g = dL/dℓ per token ([n], or one number for all): `mean_token_grad` for a mean loss.
    """
    g = _token_grad(grad_tokens, shard.x.shape[0], shard.softmax)
    alpha = shard.local_sum * torch.exp(shard.local_max - stats.global_max) / stats.sum_exp
    d = shard.softmax * (alpha * g)[:, None]
    hit = shard.target_column >= 0
    rows = torch.nonzero(hit)[:, 0]
    d[rows, shard.target_column[rows]] -= g[rows]
    grad = d.to(shard.x.dtype).T @ shard.x
    return grad if dtype is None else grad.to(dtype)


def output_input_grad(stats: OutputStats, grad_tokens: Tensor | float, dtype: torch.dtype | None = None) -> Tensor:
    """dL/dX [n, h] on the last stage, from C0's result: g ⊙ Σ_r (α_r·G_r − Y_r)."""
    g = _token_grad(grad_tokens, stats.input_grad.shape[0], stats.input_grad)
    grad = stats.input_grad * g[:, None]
    return grad if dtype is None else grad.to(dtype)


def mean_token_grad(labels: Tensor, *, ignore_index: int = IGNORE_INDEX, scale: float = 1.0,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """g for `scale` × the mean of ℓ over the labels that count (torch's cross_entropy, reduction "mean")."""
    valid = labels != ignore_index
    count = int(valid.sum())
    return valid.to(dtype) * (scale / max(count, 1))


def embedding_forward_local(tokens: Tensor, weight_shard: Tensor, part: VocabPartition, rank: int) -> Tensor:
    """Pass IF's compute on `rank`: its rows' embeddings, zero for tokens held elsewhere ([*tokens.shape, h])."""
    if weight_shard.shape[0] != part.shard_size:
        raise ValueError(f"rank {rank}'s embedding shard has {weight_shard.shape[0]} rows, expected "
                         f"{part.shard_size} for V = {part.vocab_size} over p = {part.ranks}")
    local = tokens - part.start(rank)
    mine = (local >= 0) & (local < part.real_rows(rank))
    out = weight_shard[local.clamp(0, part.shard_size - 1)]
    return out * mine[..., None].to(out.dtype)


def embedding_forward(tokens: Tensor, weight_shard: Tensor, part: VocabPartition, rank: int,
                      all_reduce: AllReduce) -> Tensor:
    """Pass IF: the local lookup and its SUM all-reduce; the result (detached) is the embedding output."""
    out = embedding_forward_local(tokens, weight_shard.detach(), part, rank).clone()
    all_reduce(out, "sum")
    return out


def embedding_weight_grad(tokens: Tensor, grad_output: Tensor, part: VocabPartition, rank: int) -> Tensor:
    """Pass IB on `rank`: the gradient of its embedding shard from dL/d(embedding output) [*tokens.shape, h]."""
    local = tokens.reshape(-1) - part.start(rank)
    mine = (local >= 0) & (local < part.real_rows(rank))
    grad = grad_output.new_zeros((part.shard_size, grad_output.shape[-1]))
    grad.index_add_(0, local[mine], grad_output.reshape(-1, grad_output.shape[-1])[mine])
    return grad


def process_group_all_reduce(group=None) -> AllReduce:
    """An `AllReduce` over a torch.distributed process group (None: the default group)."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def all_reduce(tensor: Tensor, op: str) -> None:
        dist.all_reduce(tensor, ops[op], group=group)

    return all_reduce
