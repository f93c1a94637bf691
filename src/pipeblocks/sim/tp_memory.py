"""What one tensor-parallel rank holds of a stage: its parameters' shapes and the
activations one microbatch's forward saves, at tp = t (t = 1: the whole stage).

    >>> tp_stage_param_shapes(config, num_stages=4, tp=2)[1][:4]   # a GPT layer's ln1, qkv
    ((64,), (64,), (96, 64), (96,))
    >>> tp_stage_activation_bytes(config, num_stages=4, tp=2)       # M_B per stage and rank

As `runtime.tensor_parallel` splits a stage (the GPT's plan, `models.gpt.gpt_tp_plan`, and
the Llama-style one, `models.llama.llama_tp_plan`), with h hidden, a query heads, k
key/value heads, d the head width, f_m the MLP's inner width, V the vocabulary:

parameters  the column-parallel products split by output rows, 1/t each: the fused qkv
            (GPT) or q, k and v, the MLP's up (and gate), with their biases; the
            row-parallel ones by input columns: the attention's out projection and the
            MLP's down (their biases whole); the token and position tables and the head by
            rows (vocabulary, positions). Norms (and the q/k norms of d) are whole on every
            rank. t must divide the heads, the KV heads, f_m and V (and the sequence, which
            sequence parallelism shards).
activations per token of a layer, with e the compute element size and f = max(4, e)
            (`analytic.layer_activation_bytes` lists the terms at t = 1):

                       t = 1                                    t ranks, each
    block input, residual   2*h*e                               2*h*e / t   (the token shard)
    norm statistics         2*n*f (n = 2 LayerNorm, 1 RMSNorm)  2*n*f / t
    q/k/v and MLP inputs    2*h*e (the norm outputs)            2*h*e       (all-gathered whole)
    q, k, v                 (a*d + 2*k*d)*e                     / t         (its heads)
    attention output        a*d*e                               / t
    MLP                     2*f_m*e (GELU), 4*f_m*e (SwiGLU)    / t         (its features)
    q/k norms (qk_norm)     (a*d + k*d)*e + (a + k)*f           / t
    flash log-sum-exp       a*f                                 a*f / t

  so for the GPT 2*h*e + 14*h*e/t + (4 + a)*f/t where one process saves 16*h*e + (4 + a)*f:
  the column-parallel products save their all-gathered input (torch's DTensor keeps it for
  the weight gradient; Megatron-LM gathers it again in the backward instead, which the
  34/t of its formula assumes). First stage: the token ids (and learned positions' ids),
  as at t = 1. Last stage: the final norm's input and statistics on the token shard, the
  head's input whole, and the loss whole (every rank computes it on the gathered logits).
  Rotary positions: the cos and sin tables, whole on every rank.

Dropout, when the config has it, saves its masks on the sharded tensors (1/t).
"""
from __future__ import annotations

from .analytic import _NORM_STATISTICS, TransformerConfig, _stage_sums, loss_activation_bytes

__all__ = ["tp_layer_activation_bytes", "tp_stage_activation_bytes", "tp_stage_param_shapes", "tp_mismatch"]


def tp_mismatch(config: TransformerConfig, tp: int) -> tuple[str, int] | None:
    """The first size of `config` that `tp` ranks cannot split, as (name, size), or None
    when tp divides them all: the heads, the KV heads, the MLP width, the vocabulary, the
    sequence (sequence parallelism shards the tokens) and a learned position table's rows."""
    shape = config.shape
    sizes = [("heads", config.heads), ("kv_heads", shape.num_kv_heads), ("ffn", shape.ffn_width),
             ("vocab", config.vocab), ("seq", config.seq)]
    if config.positions == "learned":
        sizes.append(("context", shape.context))
    return next(((name, size) for name, size in sizes if size % tp), None)


def _check(config: TransformerConfig, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}: give 1 or more tensor-parallel ranks")
    wrong = tp_mismatch(config, tp)
    if wrong is not None:
        raise ValueError(f"tp {tp} does not divide the model's {wrong[0]} ({wrong[1]}): give a tp that divides it")


def tp_stage_param_shapes(config: TransformerConfig, num_stages: int, tp: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The shapes of one tensor-parallel rank's share of every global stage's trainable
    parameters, in module order (`memory_estimate.stage_param_shapes` at tp = 1).

    The reference GPT (`TransformerConfig.fused_qkv`), per layer: ln1 (weight, bias), qkv
    (weight, bias), proj, ln2, fc1, fc2. Other shapes, as the Llama-style model orders
    them: the first norm, q, k, v (with biases under linear_bias or qkv_bias), the q and k
    norms (qk_norm), o (with a bias under linear_bias), the second norm, the MLP's gate (SwiGLU)
    and up, down. First stage: the token table, and a learned position table; last stage:
    the final norm and the head (no bias); a tied head is each end stage's own tensor, and
    one tensor on a single stage."""
    _check(config, tp)
    shape = config.shape
    h, V, t = config.hidden, config.vocab, tp
    q, kv, f, d = shape.q_width // t, shape.kv_width // t, shape.ffn_width // t, shape.dim
    norm = ((h,), (h,)) if config.norm == "layernorm" else ((h,),)
    biased = config.linear_bias
    qkv_biased = biased or config.qkv_bias

    def column(rows: int, bias: bool) -> tuple[tuple[int, ...], ...]:
        return ((rows, h), (rows,)) if bias else ((rows, h),)

    def row(columns: int) -> tuple[tuple[int, ...], ...]:
        return ((h, columns), (h,)) if biased else ((h, columns),)

    if config.fused_qkv:
        attention = column(q + 2 * kv, qkv_biased)
    else:
        attention = column(q, qkv_biased) + column(kv, qkv_biased) + column(kv, qkv_biased)
        attention += ((d,), (d,)) if config.qk_norm else ()
    mlp = column(f, biased) * (shape.mlp_matrices - 1) + row(f)
    layer = norm + attention + row(q) + norm + mlp
    first = ((V // t, h),) + (((shape.context // t, h),) if config.positions == "learned" else ())
    last = norm + (() if config.tied and num_stages == 1 else ((V // t, h),))
    final = num_stages - 1
    return tuple(
        (first if i == 0 else ()) + layer * n + (last if i == final else ())
        for i, n in enumerate(config.stage_layers(num_stages))
    )


def tp_layer_activation_bytes(config: TransformerConfig, tp: int) -> float:
    """Bytes one layer's forward saves per microbatch on one of `tp` ranks (whole sequences)."""
    _check(config, tp)
    s, b, h, a, t = config.seq, config.microbatch_size, config.hidden, config.heads, tp
    shape = config.shape
    e = config.dtype_bytes
    f = max(4, e)
    # per token: what each rank saves of its heads and features, and the statistics of its token shard
    sharded = 2 * h + 2 * shape.q_width + 2 * shape.kv_width + (2 if config.mlp == "gelu" else 4) * shape.ffn_width
    statistics = 2 * _NORM_STATISTICS[config.norm] + (a if config.flash_attention else 0)
    if config.qk_norm:
        sharded += shape.q_width + shape.kv_width
        statistics += a + shape.num_kv_heads
    per_token = 2 * h * e + sharded * e / t + statistics * f / t
    if not config.flash_attention:
        per_token += a * s * e / t
    if config.dropout:
        per_token += (2 * h + (0 if config.flash_attention else a * s * (1 + e))) / t
    return s * b * per_token


def tp_stage_activation_bytes(config: TransformerConfig, num_stages: int, tp: int) -> tuple[float, ...]:
    """M_B per global stage for one microbatch on one of `tp` ranks (`analytic.stage_activation_bytes`
    at tp = 1)."""
    s, b, h, t = config.seq, config.microbatch_size, config.hidden, tp
    e, f = config.dtype_bytes, max(4, config.dtype_bytes)
    layer = tp_layer_activation_bytes(config, tp)
    embed = 8 * s * b + (8 * s if config.positions == "learned" else 0) + (s * b * h / t if config.dropout else 0)
    head = s * b * (h * e / t + _NORM_STATISTICS[config.norm] * f / t + h * e) + loss_activation_bytes(config)
    return _stage_sums(config, num_stages, layer, embed, head)
