"""The simulator's side of the vocabulary passes (`vocab.py`).

A vocabulary pass is a compute op of its rank (`VocabCosts.duration`); S allocates
`mem_st` at its start and T frees it at its end. What the passes wait for
(`vocab_links.links`) becomes keys in the simulator's send/receive table, as negative
integers, each arriving `vocab_links.delay` after its send: the broadcast of X after the
last stage's forward, C0 after every rank's S (so T, and with one barrier the last
stage's backward, start once the slowest rank's S has run plus the all-reduce), C1 after
every rank's T, IF's all-reduce before stage 0's forward, the embedding gradient's
broadcast after stage 0's backward. Collectives are taken not to contend with each other
on the link (each is priced alone).

Static memory: each rank holds `VocabCosts.params` more parameters (its V/p rows of the
embedding and the head), priced as one more stage under the first stage's policy. With
data parallelism their gradients are reduced over the replicas at the end of the step,
after the last T and IB (`vocab_reduce`: `VOCAB_REDUCE_GRAD` on the communication stream).
"""
from __future__ import annotations

from ..cost.dp_model import static_bytes, static_peak_bytes
from ..ir.errors import ScheduleError
from ..ir.sharding import ShardingPolicy
from ..ir.program import Program
from ..ir.vocab import VocabPass
from ..lowering.vocab_links import barriers_of, delay, links

__all__ = ["vocab_keys", "vocab_reduce", "vocab_sends", "vocab_static"]


def vocab_keys(program: Program, table):
    """None for a Program without vocabulary passes; else (per rank the `links` table,
    key -> negative int, negative int -> its delay)."""
    if not any(type(op) is VocabPass for ops in program.ranks for op in ops):
        return None
    if table.vocab is None:
        raise ScheduleError(
            "the Program holds vocabulary passes but the costs price none: give Costs(vocab=VocabCosts(...)) "
            "(--vocab-parallel sets them from the model)"
        )
    per_rank = links(program, barriers_of(program))
    ids: dict = {}
    delays: dict[int, float] = {}
    for table_of in per_rank:
        for recv, send in table_of.values():
            for key in (*recv, *send):
                if key not in ids:
                    ids[key] = -1 - len(ids)
                    delays[ids[key]] = delay(key, table.vocab)
    return per_rank, ids, delays


def vocab_sends(sends: list, keys, ids) -> None:
    """Add `keys` to the sends of the compute op last appended."""
    for key in keys:
        k = ids[key]
        before = sends[-1]
        sends[-1] = k if before is None else (*((before,) if type(before) is int else before), k)


def vocab_static(table, peak: bool) -> float:
    """Static bytes of one rank's vocabulary rows (between steps, or at the step's peak).
    The rows are replicated over the replicas whatever the stages' sharding (the runtime
    averages their gradients over dp after the step, `runtime.vocab_step`)."""
    dp = table.data_parallel
    if peak:
        return static_peak_bytes(table.vocab.params, ShardingPolicy.REPLICATE, dp.dp, dp.bytes)
    return static_bytes(table.vocab.params, ShardingPolicy.REPLICATE, dp.dp, dp.bytes)


def vocab_reduce(table) -> list[tuple[str, float]]:
    """The data-parallel reduction of a rank's vocabulary rows' gradients at the end of the
    step, as (text, duration) for the communication stream (none without vocabulary
    parallelism or with one replica)."""
    dp = table.data_parallel
    if table.vocab is None or dp.dp <= 1 or not table.vocab.params:
        return []
    return [("VOCAB_REDUCE_GRAD", dp.op_time("REDUCE_GRAD", table.vocab.params, ShardingPolicy.REPLICATE))]
