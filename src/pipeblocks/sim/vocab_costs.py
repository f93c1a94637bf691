"""The price of vocabulary parallelism: its passes, their collectives and what moves off the end stages.

With `--vocab-parallel` (Vocabulary Parallelism, Yeung, Qi, Lin, Wan, MLSys 2025;
docs/vocab-parallel.md) the head, its softmax cross entropy and the input embedding leave the
end stages and are split by vocabulary rows over all p pipeline ranks, each holding
``V_r = ceil(V/p)`` rows (padding included: a padded row is computed like a real one). Per rank
and per microbatch, with n = s*b tokens, h hidden, e the activation element size and f = max(4, e)
the softmax's (`core.ir.vocab.VocabCosts`, the fields the simulator reads)::

    t_s      S: the logits shard X.W_rᵀ (2*n*h*V_r FLOPs, at F's efficiency) and, with one barrier,
             G_r = P̃_r.W_r (2*n*h*V_r, at B's), plus the softmax streaming n*V_r*(2e + f) bytes
    t_t      T: ∇W_r = D_rᵀ.X (2*n*h*V_r, at W's), plus n*V_r*(f + e) bytes for D_r
    t_if     IF: the rows' lookup, n*h*e read and written;  t_ib  IB: the rows' scatter, 3*n*h*e
    t_bcast  X to every rank: a broadcast of n*h*e bytes
    t_c0     C0: two all-reduces back to back, a max of 3*p*n*f bytes (every rank's maximum,
             sum of exponentials and target logit, gathered), then the sum of n*h*f bytes
             (alpha_r.G_r - Y_r, the input gradient)
    t_if_reduce   the all-reduce (sum) of IF's n*h*e output;  t_ib_bcast  the broadcast of its gradient
    mem_st   held from S to T: X (n*h*e), the softmax shard (n*V_r*f), G_r until C0 (n*h*f), the
             statistics and the label's column (n*(2f + 8))
    (IF's output, n*h*e, is stage 0's input, which its forward's activation already counts)
    params   V_r*h per table: the embedding's and the head's rows (one table when tied)

The FLOPs are the unsplit head's over p (F, B and W each 2*n*h*V); the bytes streamed are the
unsplit cross entropy's over p (`sim.analytic.cross_entropy_bytes`), priced at the memory
bandwidth (nothing where it is unknown). Collectives run over the p pipeline ranks on the
profile's pipeline link (bandwidth B, latency L): a ring all-reduce of x bytes takes
2(p-1)/p * x/B + 2(p-1)*L, a broadcast x/B + (p-1)*L (pipelined). At p = 1 there is nothing to
exchange and every collective costs 0.

`with_vocab_parallel` takes the analytic model's per-stage costs and moves the head and loss
out of the last stage (its F, B and W time, the final norm's output and the loss's saved bytes,
the head's parameters) and the token table out of the first (its parameters and the token ids it
saved; a recomputed stage 0 now keeps a hidden state as its input), and attaches the
`VocabCosts` above. The final norm stays on the last stage: its output X is what S reads.

    >>> from pipeblocks.sim.analytic import MODELS, HARDWARE, transformer_costs
    >>> config, a100 = MODELS["llama-3-8b"], HARDWARE["a100"]
    >>> costs = with_vocab_parallel(transformer_costs(config, a100, num_stages=8), config, a100, ranks=8)
    >>> round(costs.vocab.t_s / costs.vocab.t_t, 2)       # S runs two products, T one (and more bytes)
    1.95
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..core.cost.costs import BlockCosts, Costs
from ..core.cost.dp_model import Link, all_reduce_time
from ..core.ir.errors import ScheduleError
from ..core.cost.vocab_partition import VocabPartition, partition_vocab
from ..core.ir.vocab import VocabCosts
from .analytic import (
    Hardware, TransformerConfig, cross_entropy_bytes, head_flops, head_intensity, loss_activation_bytes,
)

__all__ = ["vocab_costs", "head_seconds", "head_activation_bytes", "with_vocab_parallel", "shard_rows",
           "strip_blocks", "RankLoad", "rank_loads"]


def shard_rows(vocab: int, ranks: int) -> int:
    """Rows each rank holds, padding included: ceil(V/p) (`core.cost.vocab_partition`)."""
    return VocabPartition(vocab, ranks).shard_size


def _broadcast(nbytes: float, ranks: int, hardware: Hardware) -> float:
    if ranks == 1:
        return 0.0
    return nbytes / hardware.bandwidth + (ranks - 1) * hardware.latency


def head_seconds(config: TransformerConfig, hardware: Hardware) -> tuple[float, float, float]:
    """(F, B, W) seconds of the unsplit head and loss on the last stage, as `transformer_costs`
    prices them: 2*s*b*h*V FLOPs in each at the head's efficiency, and the cross entropy's bytes
    at the memory bandwidth in F and B."""
    flops, intensity = head_flops(config), head_intensity(config)
    loss = (*cross_entropy_bytes(config), 0.0)
    bandwidth = hardware.memory_bandwidth
    return tuple(
        flops / (hardware.flops * hardware.fraction(kind, intensity)) + (loss[kind] / bandwidth if bandwidth else 0.0)
        for kind in range(3)
    )


def head_activation_bytes(config: TransformerConfig) -> float:
    """What the last stage stops saving per microbatch when the head leaves it: the final
    norm's output (the head product's input, s*b*h*e) and the loss's log-probabilities,
    targets and scalar (`analytic.loss_activation_bytes`). The norm's input and statistic stay."""
    return config.hidden_bytes + loss_activation_bytes(config)


def vocab_costs(config: TransformerConfig, hardware: Hardware, *, ranks: int,
                gemm_efficiency: float = 1.0) -> VocabCosts:
    """Per rank and per microbatch, the vocabulary passes of `config` split over `ranks`
    pipeline ranks (the module docstring has every term). `gemm_efficiency`: a further share
    of the achievable rate the shard's products reach (the planner's intensity model, 1: none)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ScheduleError(f"vocabulary parallelism needs p >= 1 pipeline ranks, got {ranks!r}")
    try:
        rows = partition_vocab(config.vocab, ranks).shard_size
    except ValueError as err:
        raise ScheduleError(str(err)) from None
    shard = dataclasses.replace(config, vocab=rows)
    n, h = config.seq * config.microbatch_size, config.hidden
    e, f = config.dtype_bytes, max(4, config.dtype_bytes)
    product = head_flops(shard)  # 2*n*h*V_r
    intensity = head_intensity(shard)
    bandwidth = hardware.memory_bandwidth
    link = Link(hardware.bandwidth, hardware.latency)  # the collectives run on the pipeline's link

    def gemm(kind: int) -> float:
        return product / (hardware.flops * hardware.fraction(kind, intensity) * gemm_efficiency)

    def streamed(nbytes: float) -> float:
        return nbytes / bandwidth if bandwidth else 0.0

    loss_f, loss_b = cross_entropy_bytes(shard)
    hidden_bytes = n * h * e
    return VocabCosts(
        t_s=gemm(0) + gemm(1) + streamed(loss_f),
        t_t=gemm(2) + streamed(loss_b),
        t_if=streamed(2 * hidden_bytes),
        t_ib=streamed(3 * hidden_bytes),
        t_bcast=_broadcast(hidden_bytes, ranks, hardware),
        t_c0=all_reduce_time(3 * ranks * n * f, ranks, link) + all_reduce_time(n * h * f, ranks, link),
        t_c1=0.0,
        t_if_reduce=all_reduce_time(hidden_bytes, ranks, link),
        t_ib_bcast=_broadcast(hidden_bytes, ranks, hardware),
        mem_st=float(hidden_bytes + n * rows * f + n * h * f + n * (2 * f + 8)),
        params=float(rows * h * (1 if config.tied else 2)),
        barriers=1,
    )


def _per_stage(costs: Costs, name: str, num_stages: int) -> list[float]:
    value = getattr(costs, name)
    if not isinstance(value, tuple) or len(value) != num_stages:
        raise ScheduleError(f"vocabulary parallelism needs per-stage costs (the analytic model's); {name} is {value!r}")
    return list(value)


def with_vocab_parallel(costs: Costs, config: TransformerConfig, hardware: Hardware, *, ranks: int,
                        head: tuple[float, float, float] | None = None, gemm_efficiency: float = 1.0) -> Costs:
    """`costs` (the analytic model's, per global stage) with the head and loss taken off the last
    stage and the token table off the first, and `vocab` set to their split passes over `ranks`.
    `head`: the (F, B, W) seconds to take off the last stage (default `head_seconds`: the
    simulator's pricing; the planner passes its own) and `gemm_efficiency` goes to `vocab_costs`."""
    num_stages = len(costs.t_f) if isinstance(costs.t_f, tuple) else 0
    if num_stages < 2:
        raise ScheduleError(
            "vocabulary parallelism moves the head off the last stage and the embedding off the first: it needs "
            f"a pipeline of at least 2 stages (got {num_stages or 'scalar costs'}); use --pp 2 or more")
    last = num_stages - 1
    head = head_seconds(config, hardware) if head is None else head
    times = {}
    for kind, name in enumerate(("t_f", "t_b", "t_w")):
        values = _per_stage(costs, name, num_stages)
        values[last] = max(0.0, values[last] - head[kind])
        times[name] = tuple(values)
    mem_b = _per_stage(costs, "mem_b", num_stages)
    tokens = config.seq * config.microbatch_size
    kept_last = max(0.0, mem_b[last] - head_activation_bytes(config))
    kept_first = max(0.0, mem_b[0] - 8 * tokens)  # the token ids go with the embedding
    ratio = costs.mem_w_ratio
    if isinstance(ratio, tuple):  # per stage (`memory_estimate.activation_costs`): M_W of the last stage
        ratio = list(ratio)
        held = ratio[last] * mem_b[last]
        if held >= mem_b[last] - loss_activation_bytes(config) - 1.0:
            ratio[last] = 1.0  # W keeps the whole graph but the loss, which has left
        elif kept_last > 0:  # W keeps its products' operands: no longer the head's input and logit gradients
            ratio[last] = min(1.0, max(0.0, held - tokens * (config.hidden + config.vocab) * config.dtype_bytes)
                              / kept_last)
        ratio = tuple(ratio)
    recompute = costs.recompute_input_ratio
    if isinstance(recompute, tuple):  # a recomputed stage keeps its input: stage 0's is now a hidden state
        recompute = list(recompute)
        for stage, kept in ((0, kept_first), (last, kept_last)):
            recompute[stage] = min(1.0, config.hidden_bytes / kept) if kept > 0 else 1.0
        recompute = tuple(recompute)
    mem_b[0], mem_b[last] = kept_first, kept_last
    table = config.hidden * config.vocab
    params = _per_stage(costs, "params", num_stages)
    params[0] = max(0.0, params[0] - table)
    params[last] = max(0.0, params[last] - table)
    blocks = costs.blocks
    if blocks is not None:
        blocks = strip_blocks(blocks, table)
    return dataclasses.replace(
        costs, **times, mem_b=tuple(mem_b), mem_w_ratio=ratio, recompute_input_ratio=recompute,
        params=tuple(params), blocks=blocks, vocab=vocab_costs(config, hardware, ranks=ranks, gemm_efficiency=gemm_efficiency),
    )


def strip_blocks(blocks: BlockCosts, table: float) -> BlockCosts:
    """The blocks without the token table (first block of stage 0) and the head (last block of
    the last stage); the last stage's layers, all alike, share its passes evenly."""
    params = [list(row) for row in blocks.params]
    params[0][0] = max(0.0, params[0][0] - table)
    params[-1][-1] = max(0.0, params[-1][-1] - table)
    even = tuple(1.0 / len(blocks.params[-1]) for _ in blocks.params[-1])

    def shares(table_: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return table_[:-1] + (even,)

    return BlockCosts(tuple(tuple(r) for r in params), shares(blocks.f), shares(blocks.b), shares(blocks.w))


@dataclass(frozen=True)
class RankLoad:
    """One pipeline rank's work per microbatch and what it holds (seconds, bytes or parameters).

    compute: its stages' F + B + W, plus the vocabulary passes S + T + IF + IB when split.
    params: its stages' parameters, plus its vocabulary rows.
    activation: its stages' M_B per microbatch, plus the S -> T state.
    """

    rank: int
    compute: float
    params: float
    activation: float


def rank_loads(costs: Costs, stage_to_rank: tuple[int, ...]) -> tuple[RankLoad, ...]:
    """Per rank, the sum over the stages it holds (`stage_to_rank[s]`, a placement's map) of
    one microbatch's pass times, parameters and stored activation, with each rank's share of
    the vocabulary passes when `costs.vocab` is set: the balance a split or vocabulary
    parallelism is after, before any schedule orders the passes."""
    num_stages = len(stage_to_rank)
    ranks = max(stage_to_rank) + 1
    t = [_per_stage(costs, name, num_stages) for name in ("t_f", "t_b", "t_w")]
    params, mem_b = _per_stage(costs, "params", num_stages), _per_stage(costs, "mem_b", num_stages)
    vocab = getattr(costs, "vocab", None)
    out = []
    for r in range(ranks):
        stages = [s for s in range(num_stages) if stage_to_rank[s] == r]
        compute = sum(t[k][s] for k in range(3) for s in stages)
        held, act = sum(params[s] for s in stages), sum(mem_b[s] for s in stages)
        if vocab is not None:
            compute += vocab.t_s + vocab.t_t + vocab.t_if + vocab.t_ib
            held += vocab.params
            act += vocab.mem_st
        out.append(RankLoad(r, compute, held, act))
    return tuple(out)

