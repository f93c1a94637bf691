"""Tensor parallelism of a Hugging Face decoder's stage, by transformers' module names.

The plan is the built-in Llama's (`models.llama.llama_tp_plan`, Megatron's split with
sequence parallelism), named as transformers names the modules: q, k, v, gate and up split
by columns (heads, KV heads, inner features; Qwen2's q/k/v biases with them), o_proj and
down_proj by rows, the embedding by vocabulary rows and the head by vocabulary columns,
the RMSNorms on the token shard. Qwen3's per-head q and k norms run on this rank's heads
(`SequenceParallel` over the heads dimension of [b, s, heads, d]): their weights are
replicated, and their gradients, partial on each rank, are summed over the group.
"""
from __future__ import annotations

from ..tp_plan import TPPlan

__all__ = ["hf_tp_plan"]


def hf_tp_plan(qk_norm: bool = False):
    """The `models.tp_plan.TPPlan` of a supported Hugging Face decoder; qk_norm: Qwen3's q/k norms."""
    from torch.distributed.tensor import Replicate, Shard  # DTensor takes 0.4 s to import: loaded only for a tensor-parallel run
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
    )

    block = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                        use_local_output=True),
        **{f"self_attn.{name}": ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=True),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    if qk_norm:
        block.update({f"self_attn.{name}": SequenceParallel(sequence_dim=2, use_local_output=True)
                      for name in ("q_norm", "k_norm")})
    first = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                                   use_local_output=False)}
    last = {"model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    return TPPlan(block=block, first=first, last=last)
