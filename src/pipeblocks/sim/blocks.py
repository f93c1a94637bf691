"""The analytic model's blocks: per stage, each transformer layer's parameters and share of
the pass times, so that the simulator can time data-parallel communication per block
(`core.costs.BlockCosts`, `core.dp_units`).

Per layer, as `sim.analytic` counts a stage (same formulas, split by layer): 12h^2 + 13h
parameters, and F = s*b*h*(24h + 4s), B = s*b*h*(24h + 8s), W = 24*s*b*h^2 FLOPs. The
embeddings (V + s)*h join the first layer of stage 0 and the head (final LayerNorm and
untied LM head, 2h + h*V parameters, 2*s*b*h*V FLOPs in each of F, B and W) the last layer
of the last stage: a DP unit holds the end parts with their neighbouring block.

    >>> from pipeblocks.sim.analytic import MODELS
    >>> blocks = transformer_blocks(MODELS["6.2b"], num_stages=8)
    >>> blocks.counts
    (3, 4, 4, 4, 4, 4, 4, 3)
"""
from __future__ import annotations

from ..core.costs import BlockCosts
from .analytic import TransformerConfig, layer_split

__all__ = ["transformer_blocks"]


def transformer_blocks(config: TransformerConfig, *, num_stages: int) -> BlockCosts:
    """Per global stage, its layers' parameters and shares of F, B and W."""
    s, b, h, V = config.seq, config.microbatch_size, config.hidden, config.vocab
    layer_params = 12 * h * h + 13 * h
    flops = {"f": s * b * h * (24 * h + 4 * s), "b": s * b * h * (24 * h + 8 * s), "w": 24 * s * b * h * h}
    head_flops = 2 * s * b * h * V
    last = num_stages - 1
    params, shares = [], {kind: [] for kind in flops}
    for stage, n in enumerate(layer_split(config.layers, num_stages)):
        row = [float(layer_params)] * n
        if stage == 0:
            row[0] += (V + s) * h
        if stage == last:
            row[-1] += 2 * h + h * V
        params.append(tuple(row))
        for kind, per_layer in flops.items():
            work = [float(per_layer)] * n
            if stage == last:
                work[-1] += head_flops
            total = sum(work)
            shares[kind].append(tuple(x / total for x in work))
    return BlockCosts(tuple(params), tuple(shares["f"]), tuple(shares["b"]), tuple(shares["w"]))
