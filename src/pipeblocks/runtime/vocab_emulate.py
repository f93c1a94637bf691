"""The vocabulary passes in emulated compute: each sleeps its modelled time, its communication is real.

Under emulated compute (`emulate.EmulatedCompute(..., vocab_parallel=True)`) the stages'
passes sleep their modelled times while tensors of the real shapes cross gloo. The IF, S,
T and IB passes of a Program lowered with vocabulary parallelism (`core.lowering.vocab_place`) do
the same: a `vocab_step.VocabStep` runs them on small real tables (a toy vocabulary of the
toy hidden width, `toy_vocab_step`, or the run's own model), and `VocabPassTimes`, its
`before_pass`, sleeps each pass's modelled time once the pass's input is in and before its
arithmetic::

    IF5   sleep t_if, then embed and issue IF5's all-reduce
    S5    receive X5 (or take it, on the last stage's rank), sleep t_s, then the logits
          shard and its statistics, and issue C0
    T5    wait for C0's statistics, sleep t_t, then the head rows' gradient
    IB5   receive the embedding output's gradient, sleep t_ib, then the rows' gradient

What is real: every transfer and collective of the passes (X and the embedding gradient
point to point, C0 and IF's all-reduce on their own process groups, through the same
`vocab_link.DistVocabLink` as in training), in the same order, carrying toy-sized tensors,
as the stages' transfers carry toy activations. Like those transfers, the collectives'
modelled times (`VocabCosts.t_bcast`, `t_c0`, `t_c1`, `t_if_reduce`, `t_ib_bcast`) are NOT
slept: they take what the toy tensors take on the machine, and the simulator, which prices
them, differs from the run by that as by the stages' transfers. The toy arithmetic (tens of
microseconds) runs after the sleep, like the runtime's own time between passes.

    times = VocabPassTimes.from_costs(costs.vocab, ms_per_unit=1e3 * scale)   # costs in seconds
    step = toy_vocab_step(rank, link, ranks=p, vocab=32, hidden=64, first=0, last=p - 1, before_pass=times)
    runner = PipelineRunner(schedule, mine, loss, compute=EmulatedCompute(..., vocab_parallel=True),
                            vocab=step, vocab_costs=costs)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..core.ir.vocab import VocabCosts, VocabPass
from .emulate import precise_sleep
from .vocab_exec import VocabLink
from .vocab_parallel import partition_vocab, shard_rows
from .vocab_step import VocabStep

__all__ = ["VocabPassTimes", "toy_vocab_step"]


@dataclass(frozen=True)
class VocabPassTimes:
    """Milliseconds each vocabulary pass sleeps (per microbatch, on every rank); called with
    a pass (`VocabStep`'s `before_pass`), it sleeps that pass's time."""

    if_ms: float
    s_ms: float
    t_ms: float
    ib_ms: float

    def __post_init__(self) -> None:
        for name in ("if_ms", "s_ms", "t_ms", "ib_ms"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"vocabulary pass time {name} must be >= 0 ms, got {value!r}")

    @classmethod
    def from_costs(cls, costs: VocabCosts, *, ms_per_unit: float) -> VocabPassTimes:
        """The passes of `costs` (t_if, t_s, t_t, t_ib), each unit lasting `ms_per_unit`: 1e3 *
        scale for costs in seconds (as `EmulatedCosts.from_costs` scales the stages'), a
        layer's forward milliseconds for costs in layer-forward units."""
        if not ms_per_unit > 0:
            raise ValueError(f"ms_per_unit must be > 0, got {ms_per_unit!r}")
        return cls(costs.t_if * ms_per_unit, costs.t_s * ms_per_unit, costs.t_t * ms_per_unit,
                   costs.t_ib * ms_per_unit)

    def ms(self, kind: str) -> float:
        return {"IF": self.if_ms, "S": self.s_ms, "T": self.t_ms, "IB": self.ib_ms}[kind]

    def __call__(self, op: VocabPass) -> None:
        precise_sleep(self.ms(op.kind) / 1000.0)


def toy_vocab_step(rank: int, link: VocabLink, *, ranks: int, vocab: int, hidden: int, first: int, last: int,
                   before_pass: VocabPassTimes | None, dtype: torch.dtype = torch.float32, seed: int = 0,
                   timeout_s: float = 300.0) -> VocabStep:
    """Rank `rank`'s `VocabStep` on toy tables: `vocab` rows of width `hidden` (the stages'
    activations' last dimension) of an embedding and an untied head drawn from `seed`, split
    over `ranks`; token ids must be below `vocab`. `link` carries tensors of [tokens per
    microbatch, hidden] of `dtype`."""
    if vocab < 1 or hidden < 1:
        raise ValueError(f"toy tables need vocab >= 1 and hidden >= 1, got vocab={vocab}, hidden={hidden}")
    part = partition_vocab(vocab, ranks)
    generator = torch.Generator().manual_seed(seed)
    embedding, head = (torch.randn(vocab, hidden, generator=generator, dtype=dtype) * 0.02 for _ in range(2))
    return VocabStep(rank, part, nn.Parameter(shard_rows(embedding, part, rank)),
                     nn.Parameter(shard_rows(head, part, rank)), link, first=first, last=last, dtype=dtype,
                     timeout_s=timeout_s, before_pass=before_pass)
