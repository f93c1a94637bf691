"""Sequence-level pipelining: Seq1F1B, its interleaved variant, composition with other
schedules, the balanced split and per-chunk costs (Seq1F1B, Sun et al. 2024)."""
import pytest

from pipeblocks import Costs, ScheduleError, schedules, simulate, validate
from pipeblocks.core import Kind
from pipeblocks.schedules.sequence import split_sequence
from pipeblocks.sim.analytic import HARDWARE, TransformerConfig, layer_activation_bytes, transformer_costs
from pipeblocks.sim.sequence_split import (
    balanced_split, chunk_flops, chunk_shares, even_split, kv_buffers_held, memory_ratio, split_lengths,
)

approx = pytest.approx


def test_seq1f1b_matches_the_papers_figure():
    # p=4, m=8, k=2, first device: F1a F1b F2a F2b F3a | B1b F3b B1a F4a B2b F4b B2a (1-based)
    rank0 = [str(a) for a in schedules.get("seq1f1b")(p=4, m=8, seq_chunks=2).ranks[0]]
    assert rank0[:12] == ["0F0.0", "0F0.1", "0F1.0", "0F1.1", "0F2.0",
                          "0BW0.1", "0F2.1", "0BW0.0", "0F3.0", "0BW1.1", "0F3.1", "0BW1.0"]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_seq1f1b_closed_forms(p, m, k):
    t = simulate(schedules.get("seq1f1b")(p=p, m=m, seq_chunks=k))
    assert t.bubble_ratio == approx((p - 1) / (m * k + p - 1))
    # rank r holds (p - r - 1) + (k - 1) + 1 units of 1/k, capped by the m*k units there are
    assert list(t.peak_activation) == approx([min(m * k, p - r + k - 1) / k for r in range(p)])
    one_f_one_b = simulate(schedules.get("1f1b")(p=p, m=m))
    if m >= p:  # the memory ratio of §5.5: (k+p-1)/(kp)
        assert t.peak_activation[0] / one_f_one_b.peak_activation[0] == approx((k + p - 1) / (k * p))


@pytest.mark.parametrize("name", [n for n in schedules.names() if n not in ("seq1f1b", "seq1f1b-i")])
@pytest.mark.parametrize("p, m, k", [(2, 3, 2), (4, 8, 2), (4, 5, 4), (3, 2, 3)])
def test_every_schedule_composes_with_sequence_chunks(name, p, m, k):
    try:
        base = schedules.get(name)(p=p, m=m)
    except ScheduleError:
        pytest.skip(f"{name} does not support p={p}, m={m}")
    split = split_sequence(name, p=p, m=m, seq_chunks=k)
    validate(split)
    assert split.seq_chunks == k and split.m == m
    # every pass of every chunk exactly once, backward LIFO over chunks on every stage
    for actions in split.ranks:
        for stage in {a.stage for a in actions}:
            for mb in range(m):
                if split.chain_of_stage(stage) != split.chain_of_microbatch(mb):
                    continue  # DualPipe: the other direction's microbatch
                chunks = [a.seq_chunk for a in actions if a.stage == stage and a.microbatch == mb and a.kind is not Kind.F
                          and a.kind is not Kind.W]
                assert chunks == list(reversed(range(k)))
    # for the 1F1B-like schedules finer units never make the bubble worse nor the peak larger
    # (the V schedules are rebuilt for m*k units and can lose a little at tiny m)
    if name in ("1f1b", "zb-h1", "gpipe"):
        t, t0 = simulate(split), simulate(base)
        assert t.bubble_ratio <= t0.bubble_ratio + 1e-12
        assert max(t.peak_activation) <= max(t0.peak_activation) + 1e-12


def test_interleaved_seq1f1b_group_dial():
    low = simulate(schedules.get("seq1f1b-i")(p=4, m=8, seq_chunks=2))
    wide = simulate(schedules.get("seq1f1b-i")(p=4, m=8, seq_chunks=2, group_size=8))
    assert wide.bubble_ratio == approx(3 / (2 * 8 * 2 + 3))
    assert max(low.peak_activation) < max(wide.peak_activation)


def test_even_and_balanced_splits():
    assert even_split(10, 3) == (4, 3, 3)
    config = TransformerConfig(layers=8, hidden=512, heads=8, seq=8192, vocab=1000)
    lengths = balanced_split(8192, 4, config)
    assert sum(lengths) == 8192 and all(x > 0 for x in lengths)
    assert list(lengths) == sorted(lengths, reverse=True)  # later tokens are dearer
    bounds = [0, *__import__("itertools").accumulate(lengths)]
    flops = [chunk_flops(a, e, config) for a, e in zip(bounds, bounds[1:])]
    assert max(flops) / min(flops) < 1.001
    even = even_split(8192, 4)
    time_even, _ = chunk_shares(even, config)
    time_bal, mem_bal = chunk_shares(lengths, config)
    assert time_bal == approx([0.25] * 4, rel=1e-3)
    assert time_even[-1] > time_even[0] * 1.5  # an even split at long sequence is badly unbalanced
    flash = TransformerConfig(layers=8, hidden=512, heads=8, seq=8192, vocab=1000, flash_attention=True)
    _, mem_flash = chunk_shares(lengths, flash)
    assert sum(mem_flash) == approx(1.0)  # without stored scores, the chunks hold what the whole sequence does
    per_token = mem_flash[1] / lengths[1]
    assert mem_flash[2:] == approx([n * per_token for n in lengths[2:]])  # ... by tokens, K/V aside
    kv = mem_flash[0] - lengths[0] * per_token  # chunk 0 holds the whole sequence's K/V buffer: 4h of 34h per token
    assert kv == approx(4 / 34, rel=1e-2)
    assert mem_bal[-1] / lengths[-1] > mem_bal[0] / lengths[0]  # stored scores make later tokens dearer


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: even_split(3, 4), "cannot split a sequence of 3 tokens into 4 chunks"),
        (lambda: split_lengths(100, 2, "halves"), "unknown sequence split"),
        (lambda: chunk_shares((3, 0), TransformerConfig(2, 64, 4, 3)), "empty chunk"),
        (lambda: split_sequence("1f1b", p=2, m=2, seq_chunks=0), "seq_chunks must be an integer >= 1"),
    ],
)
def test_bad_sequence_input(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()


def test_analytic_long_sequence_seq1f1b_against_1f1b():
    config = TransformerConfig(layers=16, hidden=2048, heads=16, seq=16384, flash_attention=True)
    p, m, k = 4, 8, 4
    base = schedules.get("1f1b")(p=p, m=m)
    split = schedules.get("seq1f1b")(p=p, m=m, seq_chunks=k)
    costs = transformer_costs(config, HARDWARE["a100"], num_stages=p)
    t0 = simulate(base, costs)
    results = {}
    for how in ("even", "balanced"):
        seq_time, seq_mem = chunk_shares(split_lengths(config.seq, k, how, config), config)
        results[how] = simulate(split, Costs(**{**costs.__dict__, "seq_time": seq_time, "seq_mem": seq_mem}))
    assert results["balanced"].makespan < results["even"].makespan < t0.makespan
    ratio = results["even"].peak_activation[0] / t0.peak_activation[0]
    # (k+p-1)/(kp) of the activations but K/V; rank 0 holds 3 whole-sequence K/V buffers at its peak
    per_layer = layer_activation_bytes(config, config.seq, config.seq)
    kv_fraction = (per_layer - layer_activation_bytes(config, config.seq, config.seq, kv=False)) / per_layer
    assert kv_buffers_held(split, 0) == 3
    want = memory_ratio(p, k, kv_fraction=kv_fraction, buffers=3)
    assert want > (k + p - 1) / (k * p) + 0.03
    assert ratio == approx(want, rel=1e-6)


@pytest.mark.parametrize("p, k, held", [(2, 2, 2), (4, 2, 3), (4, 4, 3), (8, 4, 4)])
def test_kv_buffers_held_on_rank0(p, k, held):
    # p=4, k=4: after 0BW0.2 rank 0 runs 0F2.0, holding chunks of microbatches 0, 1 and 2
    schedule = schedules.get("seq1f1b")(p=p, m=2 * p, seq_chunks=k)
    assert kv_buffers_held(schedule, 0) == held
    assert kv_buffers_held(schedule, p - 1) <= held  # the last rank holds fewer chunks in flight
    assert memory_ratio(p, k) == approx((k + p - 1) / (k * p))
    assert memory_ratio(p, k, kv_fraction=1.0, buffers=held) == approx(held / p)  # all K/V: buffers alone count
    with pytest.raises(ScheduleError, match="buffers >= 1"):
        memory_ratio(p, k, kv_fraction=0.1)


def test_a_kv_share_without_buffers_names_the_number_given():
    with pytest.raises(ScheduleError, match=r"kv_fraction 0.1 needs .* got 0$"):
        memory_ratio(2, 2, kv_fraction=0.1, buffers=0)
