"""Where to cut a sequence into k chunks, and what each chunk costs.

Causal attention makes later tokens dearer: the tokens [a, e) attend to e keys on average
more than earlier ones. FLOPs of the tokens [a, e), s = e - a, for L layers, hidden H,
h heads of size d = H/h, FFN size F_ff and vocabulary V (ALGORITHMS.md §5.4)::

    C(a, e) = 4sHV + L * [(4d+3) h (s e - s^2/2) + 8 s H^2 + 4 s H F_ff]

`balanced_split` equalises C over the chunks, solving from the end of the sequence:
C(e-s, e) = C_total/k is the quadratic alpha s^2 - beta s + gamma = 0 with
alpha = L(4d+3)h/2, beta = 4HV + L[(4d+3)h e + 8H^2 + 4H F_ff], gamma = C_total/k, whose
smaller root is the chunk length; the first chunk takes the remainder. `even_split` cuts
equal token counts. `chunk_shares` gives each chunk's share of the microbatch's time and
activation memory, for `Costs(seq_time=..., seq_mem=...)`.
"""
from __future__ import annotations

import math

from ..core.errors import ScheduleError
from .analytic import TransformerConfig

__all__ = ["even_split", "balanced_split", "split_lengths", "chunk_flops", "chunk_shares", "SPLITS"]

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


def chunk_flops(start: int, end: int, config: TransformerConfig, ffn: int | None = None) -> float:
    """Forward FLOPs of tokens [start, end) of one sequence, attention over a causal prefix."""
    H, h, V, L = config.hidden, config.heads, config.vocab, config.layers
    d, f = H // h, ffn or 4 * H
    s = end - start
    return 4 * s * H * V + L * ((4 * d + 3) * h * (s * end - s * s / 2) + 8 * s * H * H + 4 * s * H * f)


def balanced_split(seq: int, k: int, config: TransformerConfig, ffn: int | None = None) -> tuple[int, ...]:
    """Chunk lengths with equal FLOPs per chunk (the first chunk gets the remainder)."""
    _check(seq, k)
    H, h, V, L = config.hidden, config.heads, config.vocab, config.layers
    d, f = H // h, ffn or 4 * H
    target = chunk_flops(0, seq, config, ffn) / k
    alpha = L * (4 * d + 3) * h / 2
    lengths: list[int] = []
    end = seq
    for _ in range(k - 1):
        beta = 4 * H * V + L * ((4 * d + 3) * h * end + 8 * H * H + 4 * H * f)
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
    """Each chunk's share of a microbatch's time (by FLOPs) and activation memory.

    Memory per layer of a chunk of s tokens with e keys: s*(34H) + 5*h*s*e (the attention
    scores of its queries against all earlier keys), from the activation formula of §1.3;
    with flash attention the scores are not stored and memory follows the token count.
    """
    if any(n < 1 for n in lengths):
        raise ScheduleError(f"sequence split {list(lengths)} has an empty chunk: every chunk needs a token")
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    flops = [chunk_flops(a, e, config) for a, e in zip(bounds, bounds[1:])]
    scores = 0 if config.flash_attention else 5 * config.heads
    memory = [n * 34 * config.hidden + scores * n * e for n, e in zip(lengths, bounds[1:])]
    return tuple(x / sum(flops) for x in flops), tuple(x / sum(memory) for x in memory)
