"""Where to cut a sequence into k chunks, and what each chunk costs.

Causal attention makes later tokens dearer: the tokens [a, e) attend to e keys on average
more than earlier ones. FLOPs of the tokens [a, e), s = e - a, for L layers, hidden H,
h query heads of width d, block matrices of W_l elements (`ModelShape.layer_weights`:
4H^2 + 2*H*F_ff for the GPT's attention and GELU MLP of width F_ff) and vocabulary V
(Seq1F1B's compute-balanced split)::

    C(a, e) = 4sHV + L * [(4d+3) h (s e - s^2/2) + 2 s W_l]
            = 4sHV + L * [(4d+3) h (s e - s^2/2) + 8 s H^2 + 4 s H F_ff]     (the GPT)

Grouped-query attention and a head width d other than H/h change only W_l (k and v are
H x k*d) and the (4d+3)h term's d: attention's products run over the query heads.
`balanced_split` equalises C over the chunks, solving from the end of the sequence:
C(e-s, e) = C_total/k is the quadratic alpha s^2 - beta s + gamma = 0 with
alpha = L(4d+3)h/2, beta = 4HV + L[(4d+3)h e + 2 W_l], gamma = C_total/k, whose
smaller root is the chunk length; the first chunk takes the remainder. `even_split` cuts
equal token counts. `chunk_shares` gives each chunk's share of the microbatch's time and
activation memory, for `Costs(seq_time=..., seq_mem=...)`.

Memory of chunks. The runtime keeps one K/V buffer per microbatch for the whole sequence,
allocated by chunk 0's forward and freed with chunk 0's backward (the microbatch's last),
so chunk 0's share carries the K/V of every token and later chunks carry none. Against
1F1B, rank 0 then holds (k+p-1)/(kp) of the other activations, as Seq1F1B's algebra has
it, plus one whole-sequence K/V per microbatch it holds a chunk of (`memory_ratio`).
"""
from __future__ import annotations

import dataclasses
import math

from ..core.cost.costs import Costs
from ..core.ir.actions import Kind
from ..core.ir.errors import ScheduleError
from ..core.ir.schedule import Schedule
from .analytic import TransformerConfig, layer_activation_bytes

__all__ = [
    "even_split", "balanced_split", "split_lengths", "chunk_flops", "chunk_shares", "kv_buffers_held", "memory_ratio",
    "SPLITS", "with_chunk_shares",
]

SPLITS = ("balanced", "even")


def _check(seq: int, k: int) -> None:
    if not isinstance(k, int) or k < 1:
        raise ScheduleError(f"sequence chunks must be an integer >= 1, got {k!r}")
    if k > seq:
        raise ScheduleError(f"cannot split a sequence of {seq} tokens into {k} chunks: use at most {seq} chunks")


def even_split(seq: int, k: int) -> tuple[int, ...]:
    """Chunk lengths differing by at most one token (earlier chunks get the extra)."""
    _check(seq, k)
    base, extra = divmod(seq, k)
    return tuple(base + (1 if i < extra else 0) for i in range(k))


def _block_sizes(config: TransformerConfig, ffn: int | None) -> tuple[int, int, int, int]:
    """H, h (query heads), d and the block's attention and MLP matrix elements (ffn: the MLP
    width instead of the config's)."""
    shape = config.shape
    H, f = config.hidden, ffn or shape.ffn_width
    attention = 2 * H * shape.q_width + 2 * H * shape.kv_width
    return H, config.heads, shape.dim, attention, shape.mlp_matrices * H * f


def chunk_flops(start: int, end: int, config: TransformerConfig, ffn: int | None = None) -> float:
    """Forward FLOPs of tokens [start, end) of one sequence, attention over a causal prefix
    (`ffn`: the MLP's width instead of the config's)."""
    V, L = config.vocab, config.layers
    H, h, d, attention, mlp = _block_sizes(config, ffn)
    s = end - start
    return 4 * s * H * V + L * ((4 * d + 3) * h * (s * end - s * s / 2) + 2 * s * attention + 2 * s * mlp)


def balanced_split(seq: int, k: int, config: TransformerConfig, ffn: int | None = None) -> tuple[int, ...]:
    """Chunk lengths with equal FLOPs per chunk (the first chunk gets the remainder)."""
    _check(seq, k)
    V, L = config.vocab, config.layers
    H, h, d, attention, mlp = _block_sizes(config, ffn)
    target = chunk_flops(0, seq, config, ffn) / k
    alpha = L * (4 * d + 3) * h / 2
    lengths: list[int] = []
    end = seq
    for _ in range(k - 1):
        beta = 4 * H * V + L * ((4 * d + 3) * h * end + 2 * attention + 2 * mlp)
        root = (beta - math.sqrt(max(beta * beta - 4 * alpha * target, 0.0))) / (2 * alpha)
        length = max(1, round(root))
        if end - length < len(lengths) + 1:  # leave at least one token for every earlier chunk
            raise ScheduleError(
                f"a balanced split of {seq} tokens into {k} chunks leaves an empty chunk: use fewer chunks"
            )
        lengths.append(length)
        end -= length
    lengths.append(end)
    return tuple(reversed(lengths))


def split_lengths(seq: int, k: int, how: str, config: TransformerConfig | None = None) -> tuple[int, ...]:
    if how == "even" or (how == "balanced" and config is None):
        return even_split(seq, k)
    if how == "balanced":
        return balanced_split(seq, k, config)
    raise ScheduleError(f"unknown sequence split {how!r}; choose one of {', '.join(SPLITS)}")


def chunk_shares(lengths: tuple[int, ...], config: TransformerConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each chunk's share of a microbatch's time (by FLOPs) and of its activation memory
    (against the whole sequence run at once).

    Memory per layer of a chunk of s tokens with e keys: its activations without K and V
    (`analytic.layer_activation_bytes` with kv=False: 14*H*e per token for the GPT), the
    attention scores of its queries against all e keys unless flash attention, and on chunk 0
    the K/V buffer of the whole sequence (2*k*d*e per token: 2*H*e for the GPT). With flash attention the shares sum to 1; stored scores make
    them sum to less (a chunk's queries see fewer keys than the whole sequence's square).
    """
    if any(n < 1 for n in lengths):
        raise ScheduleError(f"sequence split {list(lengths)} has an empty chunk: every chunk needs a token")
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    total = bounds[-1]
    flops = [chunk_flops(a, e, config) for a, e in zip(bounds, bounds[1:])]
    whole = layer_activation_bytes(config, total, total)
    kv = whole - layer_activation_bytes(config, total, total, kv=False)
    memory = [layer_activation_bytes(config, n, e, kv=False) + (kv if c == 0 else 0.0)
              for c, (n, e) in enumerate(zip(lengths, bounds[1:]))]
    return tuple(x / sum(flops) for x in flops), tuple(x / whole for x in memory)


def with_chunk_shares(costs: Costs, config: TransformerConfig, k: int, how: str = "balanced") -> Costs:
    """`costs` with the `chunk_shares` of k chunks cut `how` (`split_lengths`); k <= 1: as they are."""
    if k <= 1:
        return costs
    seq_time, seq_mem = chunk_shares(split_lengths(config.seq, k, how, config), config)
    return dataclasses.replace(costs, seq_time=seq_time, seq_mem=seq_mem)


def kv_buffers_held(schedule: Schedule, rank: int) -> int:
    """The most (stage, microbatch) K/V buffers `rank` holds at once: a buffer lives from
    chunk 0's forward to chunk 0's last backward pass (W when B and W are split)."""
    live: set[tuple[int, int]] = set()
    most = 0
    for action in schedule.ranks[rank]:
        if (action.seq_chunk or 0) != 0:
            continue
        key = (action.stage, action.microbatch)
        if action.kind is Kind.F:
            live.add(key)
            most = max(most, len(live))
        elif action.kind in (Kind.W, Kind.BW):
            live.discard(key)
    return most


def memory_ratio(p: int, k: int, *, kv_fraction: float = 0.0, buffers: int = 0) -> float:
    """Seq1F1B's rank-0 peak activation against 1F1B's, for k equal chunks.

    (k+p-1)/(kp) (the Seq1F1B paper's algebra) for everything but K and V, plus the K/V
    share: `kv_fraction` is K and V's part of one microbatch's activation, and the rank
    holds `buffers` whole-sequence K/V buffers at its peak (`kv_buffers_held`) where 1F1B
    holds p microbatches:  ratio = f + kv_fraction * (buffers/p - f),  f = (k+p-1)/(kp).
    """
    if p < 1 or k < 1:
        raise ScheduleError(f"memory_ratio needs p >= 1 and k >= 1, got p={p}, k={k}")
    if not 0 <= kv_fraction <= 1:
        raise ScheduleError(f"kv_fraction is a share of the activation, in [0, 1]; got {kv_fraction}")
    if kv_fraction > 0 and buffers < 1:
        raise ScheduleError(
            f"kv_fraction {kv_fraction} needs the number of K/V buffers held at the peak (buffers >= 1, from "
            f"kv_buffers_held), got {buffers}"
        )
    formula = (k + p - 1) / (k * p)
    return formula + kv_fraction * (buffers / p - formula)
