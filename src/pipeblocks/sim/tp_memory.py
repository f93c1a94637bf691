"""What one tensor-parallel rank holds of a stage of the reference GPT: its parameters'
shapes and the activations one microbatch's forward saves, at tp = t.

    >>> tp_stage_param_shapes(config, num_stages=4, tp=2)[1][:4]   # a layer's ln1, qkv
    ((64,), (64,), (96, 64), (96,))
    >>> tp_stage_activation_bytes(config, num_stages=4, tp=2)       # M_B per stage and rank

As `runtime.tensor_parallel` splits a stage (the GPT's plan, `models.gpt.gpt_tp_plan`):

parameters  the fused qkv and MLP up (weights and biases) split by rows, the attention
            projection and MLP down weights by columns, the token and position tables
            and the head by rows (vocabulary, positions): 1/t each. LayerNorms and the
            row-parallel layers' biases are whole on every rank.
activations per token of a layer, with e the compute element size and f = max(4, e):

                       t = 1 (analytic.layer_activation_bytes)    t ranks, each
    block input, residual   2*h*e                                 2*h*e / t   (the token shard)
    LayerNorm statistics    4*f                                   4*f / t
    QKV and MLP-up inputs   2*h*e (the LayerNorm outputs)         2*h*e       (all-gathered whole)
    Q, K, V                 3*h*e                                 3*h*e / t   (its heads)
    attention output        h*e                                   h*e / t
    MLP 4h and GELU 4h      8*h*e                                 8*h*e / t
    flash log-sum-exp       a*f                                   a*f / t

  so 2*h*e + 14*h*e/t + (4 + a)*f/t where one process saves 16*h*e + (4 + a)*f: the column-
  parallel products save their all-gathered input (torch's DTensor keeps it for the
  weight gradient; Megatron-LM gathers it again in the backward instead, which the 34/t of
  its formula assumes). First stage: the token ids and positions, as at t = 1. Last stage:
  the final LayerNorm's input and statistics on the token shard, the head's input whole,
  and the loss whole (every rank computes it on the gathered logits).

Dropout, when the config has it, saves its masks on the sharded tensors (1/t).
"""
from __future__ import annotations

from .analytic import TransformerConfig, layer_split, loss_activation_bytes

__all__ = ["tp_layer_activation_bytes", "tp_stage_activation_bytes", "tp_stage_param_shapes"]

_MLP_RATIO = 4


def _check(config: TransformerConfig, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}: give 1 or more tensor-parallel ranks")
    for name, size in (("heads", config.heads), ("hidden", config.hidden), ("vocab", config.vocab),
                       ("seq", config.seq)):
        if size % tp:
            raise ValueError(f"tp {tp} does not divide the model's {name} ({size}): give a tp that divides it")


def tp_stage_param_shapes(config: TransformerConfig, num_stages: int, tp: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The shapes of one tensor-parallel rank's share of every global stage's trainable
    parameters, in module order (`memory_estimate.stage_param_shapes` at tp = 1)."""
    _check(config, tp)
    h, V, s, t = config.hidden, config.vocab, config.seq, tp
    inner = _MLP_RATIO * h
    layer = ((h,), (h,), (3 * h // t, h), (3 * h // t,), (h, h // t), (h,), (h,), (h,), (inner // t, h), (inner // t,),
             (h, inner // t), (h,))
    last = num_stages - 1
    return tuple(
        (((V // t, h), (s // t, h)) if i == 0 else ()) + layer * n + (((h,), (h,), (V // t, h)) if i == last else ())
        for i, n in enumerate(layer_split(config.layers, num_stages))
    )


def tp_layer_activation_bytes(config: TransformerConfig, tp: int) -> float:
    """Bytes one layer's forward saves per microbatch on one of `tp` ranks (whole sequences)."""
    _check(config, tp)
    s, b, h, a, t = config.seq, config.microbatch_size, config.hidden, config.heads, tp
    e = config.dtype_bytes
    f = max(4, e)
    per_token = 2 * h * e + 14 * h * e / t + (4 + (a if config.flash_attention else 0)) * f / t
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
    embed = 8 * s * b + 8 * s + (s * b * h / t if config.dropout else 0)
    head = s * b * (h * e / t + 2 * f / t + h * e) + loss_activation_bytes(config)
    last = num_stages - 1
    return tuple(
        n * layer + (embed if i == 0 else 0) + (head if i == last else 0)
        for i, n in enumerate(layer_split(config.layers, num_stages))
    )
