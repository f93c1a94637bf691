"""The time tensor parallelism adds to a stage's passes: one model for the planner (and any
cost built from the analytic transformer model).

    >>> tp = TPCostModel(tp=2, link=Link(bandwidth=300e9, latency=5e-6), sequence_parallel=True)
    >>> tp.layer_comm(activation_bytes=s * b * h * e)   # one pass of one layer: its collectives
    >>> costs = tp.split(costs, layers=(4, 4), activation_bytes=s * b * h * e)

What `runtime.tensor_parallel` runs, per layer and pass (Megatron-LM's tensor parallelism;
Korthikanti et al. 2022 for sequence parallelism), each of the layer's activation
[s, b, h] (`activation_bytes`):

    with sequence parallelism      F: attention and MLP each all-gather their input and
                                   reduce-scatter their output (2 pairs); B: the same,
                                   transposed (2 pairs)
    without                        F: 2 all-reduces (after attention, after the MLP);
                                   B: 2 all-reduces (of the inputs' gradients)
    W                              nothing (each rank's weight-gradient shard is local)

On a ring an all-gather plus a reduce-scatter move what one all-reduce moves, so both give
2 all-reduce times per layer and pass, on the intra-node link (tp stays inside a node).
`split` divides the passes' compute by tp and adds these; a recomputed forward pays them
again (the simulator's recomputation takes the stage's forward time).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from .costs import Costs
from .dp_model import Link, all_gather_time, all_reduce_time, reduce_scatter_time

__all__ = ["TPCostModel"]


@dataclass(frozen=True)
class TPCostModel:
    """Tensor parallelism of `tp` ranks on `link`, with or without sequence parallelism."""

    tp: int
    link: Link
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {self.tp!r}")

    def layer_comm(self, activation_bytes: float) -> float:
        """Seconds of one layer's collectives in one pass (F or B) of one microbatch."""
        if self.tp == 1:
            return 0.0
        if self.sequence_parallel:
            pair = (all_gather_time(activation_bytes, self.tp, self.link)
                    + reduce_scatter_time(activation_bytes, self.tp, self.link))
            return 2 * pair
        return 2 * all_reduce_time(activation_bytes, self.tp, self.link)

    def stage_comm(self, layers: Sequence[int], activation_bytes: float) -> tuple[float, ...]:
        """Per stage with `layers[s]` layers: seconds of its collectives in one F (and in one B)."""
        return tuple(n * self.layer_comm(activation_bytes) for n in layers)

    def split(self, costs: Costs, *, layers: Sequence[int], activation_bytes: float) -> Costs:
        """`costs` of whole stages as one of `tp` ranks runs them: F, B and W compute over tp,
        F and B plus their collectives (memory and the pipeline hop are the caller's)."""
        if self.tp == 1:
            return costs
        comm = self.stage_comm(layers, activation_bytes)
        return dataclasses.replace(
            costs,
            t_f=tuple(t / self.tp + c for t, c in zip(costs.t_f, comm)),
            t_b=tuple(t / self.tp + c for t, c in zip(costs.t_b, comm)),
            t_w=tuple(t / self.tp for t in costs.t_w),
        )
