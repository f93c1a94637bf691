"""The analytic price of vocabulary parallelism (sim.vocab_costs)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.sim.analytic import HARDWARE, MODELS, TransformerConfig, transformer_costs
from pipeblocks.sim.blocks import transformer_blocks
from pipeblocks.sim.vocab_costs import head_seconds, rank_loads, vocab_costs, with_vocab_parallel

LLAMA, A100 = MODELS["llama-3-8b"], HARDWARE["a100"]


def test_split_passes_do_the_unsplit_heads_work():
    """p ranks' S + T equal the unsplit head and loss (F + B + W) when p divides V and the
    efficiency does not depend on the shape: the FLOPs and bytes are split, not added."""
    flat = dataclasses.replace(A100, passes=None)
    config = dataclasses.replace(LLAMA, vocab=128 * 1024)
    for p in (2, 4, 8):
        v = vocab_costs(config, flat, ranks=p)
        assert math.isclose(p * (v.t_s + v.t_t), sum(head_seconds(config, flat)), rel_tol=1e-12)


def test_padding_is_priced_and_collectives_grow_with_p():
    v3 = vocab_costs(dataclasses.replace(LLAMA, vocab=10), A100, ranks=3)   # 4 rows each, 2 of them padding
    v4 = vocab_costs(dataclasses.replace(LLAMA, vocab=12), A100, ranks=3)
    assert v3.t_s == v4.t_s and v3.params == v4.params == 4 * LLAMA.hidden * 2
    assert vocab_costs(LLAMA, A100, ranks=1).t_c0 == 0.0
    assert 0 < vocab_costs(LLAMA, A100, ranks=2).t_c0 < vocab_costs(LLAMA, A100, ranks=8).t_c0
    assert vocab_costs(dataclasses.replace(LLAMA, tied=True), A100, ranks=4).params == (
        vocab_costs(LLAMA, A100, ranks=4).params / 2)



def test_c0_is_two_all_reduces():
    """C0 is priced as the runtime runs it (`vocab_parallel.reduce_output`): a ring all-reduce of
    the 3*p*n gathered statistics, then one of the n*h input gradient, each 2(p-1) latencies."""
    p, n, h = 4, LLAMA.seq * LLAMA.microbatch_size, LLAMA.hidden
    moved = 2 * (p - 1) / p * (3 * p * n + n * h) * 4 / A100.bandwidth  # float32 statistics
    assert math.isclose(vocab_costs(LLAMA, dataclasses.replace(A100, latency=0.0), ranks=p).t_c0, moved,
                        rel_tol=1e-12)
    assert math.isclose(vocab_costs(LLAMA, A100, ranks=p).t_c0, moved + 2 * 2 * (p - 1) * A100.latency,
                        rel_tol=1e-12)


def test_end_stages_become_middle_stages():
    """After the move, the last stage costs a middle stage plus the final norm (kept there), and
    the first stage holds a middle stage's parameters: the vocabulary layers are gone from both."""
    p = 4  # 8 layers per stage
    base = dataclasses.replace(transformer_costs(LLAMA, A100, num_stages=p),
                               blocks=transformer_blocks(LLAMA, num_stages=p))
    costs = with_vocab_parallel(base, LLAMA, A100, ranks=p)
    for name in ("t_f", "t_b", "t_w"):
        values = getattr(costs, name)
        assert math.isclose(values[3], values[1], rel_tol=1e-12), name
    assert costs.params[0] == costs.params[1]
    assert costs.params[3] == costs.params[1] + LLAMA.hidden  # the final norm's weight
    norm_saved = LLAMA.seq * (LLAMA.hidden * LLAMA.dtype_bytes + 4)  # its input and statistic
    assert math.isclose(costs.mem_b[3], costs.mem_b[1] + norm_saved, rel_tol=1e-12)
    assert costs.mem_b[0] == costs.mem_b[1]  # the token ids left with the embedding
    assert [sum(row) for row in costs.blocks.params] == list(costs.params)
    assert costs.blocks.f[3] == (1 / 8,) * 8
    assert costs.vocab == vocab_costs(LLAMA, A100, ranks=p)


def test_rank_loads_balance_the_llama_3_8b_pipeline():
    for p in (4, 8):
        naive = rank_loads(transformer_costs(LLAMA, A100, num_stages=p), tuple(range(p)))
        split = rank_loads(with_vocab_parallel(transformer_costs(LLAMA, A100, num_stages=p), LLAMA, A100, ranks=p),
                           tuple(range(p)))
        assert naive[-1].compute > 1.2 * naive[1].compute  # the head and loss: about two layers more
        assert max(r.compute for r in split) / min(r.compute for r in split) < 1.001
        assert max(r.params for r in split) / min(r.params for r in split) < 1.001
        # the work is moved, not lost: the vocabulary passes carry the head's
        assert math.isclose(sum(r.compute for r in split), sum(r.compute for r in naive), rel_tol=0.02)


def test_v_placement_counts_two_stages_per_rank():
    p = 4
    costs = with_vocab_parallel(transformer_costs(LLAMA, A100, num_stages=2 * p), LLAMA, A100, ranks=p)
    loads = rank_loads(costs, (0, 1, 2, 3, 3, 2, 1, 0))
    assert loads[0].params == costs.params[0] + costs.params[7] + costs.vocab.params


def test_needs_two_stages():
    with pytest.raises(ScheduleError, match="at least 2 stages"):
        with_vocab_parallel(transformer_costs(LLAMA, A100, num_stages=1), LLAMA, A100, ranks=1)
    assert isinstance(LLAMA, TransformerConfig)


@pytest.mark.parametrize("w_keeps", ["graph", "weights"])
def test_what_w_keeps_on_the_last_stage_loses_the_head(w_keeps):
    """M_W of the last stage: the whole graph under "graph" (the loss, which B freed, is gone);
    under "weights" the layers' and the final norm's operands, no longer the head's."""
    from pipeblocks.sim.memory_estimate import activation_costs

    p = 4
    base = dataclasses.replace(transformer_costs(LLAMA, A100, num_stages=p),
                               **{k: getattr(activation_costs(LLAMA, p, w_keeps=w_keeps), k)
                                  for k in ("mem_b", "mem_w_ratio", "recompute_input_ratio")})
    costs = with_vocab_parallel(base, LLAMA, A100, ranks=p)
    held = [r * m for r, m in zip(costs.mem_w_ratio, costs.mem_b)]
    if w_keeps == "graph":
        assert costs.mem_w_ratio[3] == 1.0
    else:
        assert math.isclose(held[3], held[1], rel_tol=1e-12)  # the norm's input and statistic keep nothing for W
    hidden = LLAMA.seq * LLAMA.hidden * LLAMA.dtype_bytes
    assert math.isclose(costs.recompute_input_ratio[0] * costs.mem_b[0], hidden, rel_tol=1e-12)
    assert math.isclose(costs.recompute_input_ratio[3] * costs.mem_b[3], hidden, rel_tol=1e-12)


def test_a_tied_table_is_held_once_over_the_ranks():
    """Tied: the end stages each held a copy; split, the one table is V/p rows on each rank."""
    from pipeblocks.sim.vocab_memory import vocab_stage_param_shapes

    tied, p = dataclasses.replace(LLAMA, tied=True), 4
    base = transformer_costs(tied, A100, num_stages=p)
    costs = with_vocab_parallel(base, tied, A100, ranks=p)
    table = tied.vocab * tied.hidden
    assert sum(costs.params) + p * costs.vocab.params == sum(base.params) - table
    shapes = vocab_stage_param_shapes(tied, p)
    assert all((tied.vocab, tied.hidden) not in stage for stage in shapes)
    assert [sum(math.prod(s) for s in stage) for stage in shapes] == list(costs.params)
