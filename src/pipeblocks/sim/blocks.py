"""The analytic model's blocks: per stage, each transformer layer's parameters and share of
the pass times, so that the simulator can time data-parallel communication per block
(`core.cost.costs.BlockCosts`, `core.ir.dp_units`).

Per layer, as `sim.analytic` counts a stage (same formulas, split by layer): the block's
parameters (`ModelShape.layer_params`: 12h^2 + 13h for the GPT) and its F, B and W FLOPs
(`analytic.layer_flops`: s*b*h*(24h + 4s), s*b*h*(24h + 8s) and 24*s*b*h^2 for the GPT).
The embeddings (`ModelShape.embedding_params`: (V + s)*h for the GPT) join the first layer
of stage 0 and the head (`ModelShape.head_params`: the final norm and the LM head, 2h + h*V
for the GPT; a tied head's copy too, held by the last stage; on a single stage the one
tensor is counted once, with the embedding) the last layer of the last stage, with the
head's 2*s*b*h*V FLOPs in each of F, B and W: a DP unit holds the end parts with their
neighbouring block.

    >>> from pipeblocks.sim.analytic import MODELS
    >>> blocks = transformer_blocks(MODELS["6.2b"], num_stages=8)
    >>> blocks.counts
    (3, 4, 4, 4, 4, 4, 4, 3)
"""
from __future__ import annotations

from ..core.cost.costs import BlockCosts
from .analytic import TransformerConfig, head_flops, layer_flops

__all__ = ["transformer_blocks"]


def transformer_blocks(config: TransformerConfig, *, num_stages: int) -> BlockCosts:
    """Per global stage, its layers' parameters and shares of F, B and W."""
    shape = config.shape
    layer_params = shape.layer_params()
    flops = dict(zip("fbw", layer_flops(config)))
    head = head_flops(config)
    head_params = shape.head_params() - (config.hidden * config.vocab if config.tied and num_stages == 1 else 0)
    last = num_stages - 1
    params, shares = [], {kind: [] for kind in flops}
    for stage, n in enumerate(config.stage_layers(num_stages)):
        row = [float(layer_params)] * n
        if stage == 0:
            row[0] += shape.embedding_params()
        if stage == last:
            row[-1] += head_params
        params.append(tuple(row))
        for kind, per_layer in flops.items():
            work = [float(per_layer)] * n
            if stage == last:
                work[-1] += head
            total = sum(work)
            shares[kind].append(tuple(x / total for x in work))
    return BlockCosts(tuple(params), tuple(shares["f"]), tuple(shares["b"]), tuple(shares["w"]))
