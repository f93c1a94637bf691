"""How a model family's stage is split over tensor-parallel ranks: a plan of parallel styles
by module path, the sizes tp must divide (checked before anything is launched), and the
plan applied to a stage (`parallelize_stage`, by torch's DTensor `parallelize_module`).

    >>> check_tp(llama_shape(LlamaConfig(heads=4, kv_heads=2, hidden=64, seq=64, vocab=256)), 2, seq=64)   # fine
    >>> check_tp(llama_shape(LlamaConfig(heads=4, kv_heads=1)), 2, seq=64)
    ValueError: --tp 2 does not divide the model's 1 KV heads: ...
    >>> plan = llama_spec(cfg).tp_plan()           # TPPlan
    >>> parallelize_stage(stage, plan, mesh.tp_mesh)   # then runtime.tensor_parallel runs it

Every family shards the same way (Megatron's tensor parallelism with sequence parallelism,
as torchtitan writes it with `torch.distributed.tensor.parallel`):

    between blocks and stages  the hidden state [b, s, h] sharded by tokens: Shard(1), s/t each
    norms                      SequenceParallel: replicated weights, run on the token shard
    attention / MLP input      all-gathered to the whole sequence (Replicate)
    q, k, v (fused qkv), MLP up/gate   ColwiseParallel: output features (heads) split by t
    attention out, MLP down    RowwiseParallel: reduce-scattered back to the token shard
    embedding                  RowwiseParallel: vocabulary rows split, output the token shard
    LM head                    ColwiseParallel: vocabulary columns split, logits gathered whole

So the t ranks of a stage each hold 1/t of every projection and embedding, the norms
whole; a stage's input and output are its token shard, so between pipeline stages each
rank sends 1/t of the activation. This module imports no torch: the plans' styles are
built by the families' `*_tp_plan` functions, on use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["TPPlan", "check_tp", "parallelize_stage", "tp_sizes"]


@dataclass(frozen=True)
class TPPlan:
    """Parallel styles (`torch.distributed.tensor.parallel.ParallelStyle`) by module path.

    block: paths inside one block ("attn.q_proj"), applied to every block of a stage; each
        block takes and returns the token-sharded hidden state (a DTensor, Shard(1)).
    first: paths of the before-modules (stage 0): token ids in, the token shard out (a DTensor).
    last: paths of the after-modules (the last stage): the token shard in, whole logits out
        (a plain tensor, the same on every tp rank).
    """

    block: Mapping[str, Any]
    first: Mapping[str, Any]
    last: Mapping[str, Any]


def parallelize_stage(stage: Any, plan: TPPlan, tp_mesh) -> Any:
    """Shard `stage` (a `Stage`) over `tp_mesh` in place by `plan`, and make its input and output the local token shard; returns it."""
    from torch.distributed.tensor import Shard  # DTensor takes 0.4 s to import: loaded only for a tensor-parallel run
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    if getattr(stage, "tp_mesh", None) is not None:
        raise ValueError(f"stage {stage.index} is already tensor-parallel: parallelize each stage once")
    for _, block in stage.block_items():
        parallelize_module(block, tp_mesh, dict(plan.block))
    if stage.is_first:
        parallelize_module(stage, tp_mesh, dict(plan.first))
    else:  # the received token shard, as the DTensor the blocks take
        parallelize_module(stage, tp_mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                              desired_input_layouts=(Shard(1),)))
    if stage.is_last:
        parallelize_module(stage, tp_mesh, dict(plan.last))
    else:  # the local token shard is what is sent
        parallelize_module(stage, tp_mesh, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1),
                                                               use_local_output=True))
    stage.tp_mesh = tp_mesh
    return stage


def tp_sizes(shape: Any, seq: int) -> dict[str, int]:
    """Every size tensor parallelism splits, by what it is called (a `core.cost.model_shape.ModelShape`)."""
    return {
        "heads": shape.heads, "KV heads": shape.num_kv_heads, "MLP width": shape.ffn_width,
        "vocabulary": shape.vocab, "tokens per sequence (sequence parallelism)": seq,
    }


def check_tp(shape: Any, tp: int, *, seq: int) -> None:
    """Raise ValueError, naming the numbers and a fix, unless tp divides every size it splits."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"--tp must be an integer >= 1, got {tp!r}")
    if tp == 1:
        return
    for what, size in tp_sizes(shape, seq).items():
        if size % tp:
            fits = [t for t in range(1, size + 1) if size % t == 0 and t <= 64]
            raise ValueError(
                f"--tp {tp} does not divide the model's {size} {what}: tensor parallelism gives each of the {tp} ranks "
                f"an equal share; use --tp {' or '.join(map(str, fits[-4:]))}, or a model whose {what} {tp} divides"
            )
