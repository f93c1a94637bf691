"""Vocabulary parallelism's numerics equal the unsplit embedding, head and cross entropy in float64.

p ranks are simulated in one process by p threads that meet in an all-reduce (every rank
sums the same stack in the same order, as a collective does), so the functions run exactly
as they do on p processes, collectives included.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from pipeblocks.runtime import vocab_parallel as vp

pytestmark = pytest.mark.torch


class ThreadAllReduce:
    """An in-place all-reduce among p threads."""

    def __init__(self, p: int) -> None:
        self.slots: list = [None] * p
        self.barrier = threading.Barrier(p, timeout=30)

    def for_rank(self, rank: int) -> vp.AllReduce:
        def all_reduce(tensor, op):
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            stack = torch.stack(self.slots)
            result = stack.sum(0) if op == "sum" else stack.amax(0)
            self.barrier.wait()
            tensor.copy_(result)

        return all_reduce


def _run_ranks(p, fn):
    with ThreadPoolExecutor(max_workers=p) as pool:
        return [f.result() for f in [pool.submit(fn, r) for r in range(p)]]


def _case(vocab, hidden, tied, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 5), generator=g)
    labels = torch.randint(0, vocab, (2, 5), generator=g)
    labels[0, 1] = vp.IGNORE_INDEX
    labels[1, 4] = vocab - 1  # a label in the last (padded) shard
    emb = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    head = emb if tied else torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    body = torch.randn(hidden, hidden, generator=g, dtype=torch.float64)
    return tokens, labels, emb, head, body


def _reference(tokens, labels, emb, head, body, tied):
    emb, body = emb.clone().requires_grad_(), body.clone().requires_grad_()
    head = emb if tied else head.clone().requires_grad_()
    x = torch.tanh(F.embedding(tokens, emb) @ body)
    loss = F.cross_entropy((x @ head.T).reshape(-1, emb.shape[0]), labels.reshape(-1))
    loss.backward()
    return loss.detach(), emb.grad, None if tied else head.grad, body.grad


def _vocab_parallel(p, tokens, labels, emb, head, body, tied):
    part = vp.partition_vocab(emb.shape[0], p)
    group = ThreadAllReduce(p)
    flat = labels.reshape(-1)

    def rank(r):
        all_reduce = group.for_rank(r)
        emb_shard = vp.shard_rows(emb, part, r)
        head_shard = emb_shard if tied else vp.shard_rows(head, part, r)
        h0 = vp.embedding_forward(tokens, emb_shard, part, r, all_reduce)        # IF
        # the body runs on the stages; here every rank repeats it (same inputs, same result)
        h0 = h0.requires_grad_()
        b = body.clone().requires_grad_()
        x = torch.tanh(h0 @ b)
        shard, partials = vp.output_forward(x.reshape(-1, x.shape[-1]), head_shard, flat, part, r)   # S
        stats = vp.reduce_output(partials, flat, all_reduce, rank=r, ranks=p)    # C0
        g = vp.mean_token_grad(flat, dtype=torch.float64)
        loss = (stats.token_loss() * g).sum()
        head_grad = vp.output_weight_grad(shard, stats, g)                       # T
        dx = vp.output_input_grad(stats, g).reshape(x.shape)
        x.backward(dx)
        emb_grad = vp.embedding_weight_grad(tokens, h0.grad, part, r)           # IB
        return loss, emb_grad + (head_grad if tied else 0), head_grad, b.grad

    out = _run_ranks(p, rank)
    for loss, *_ in out[1:]:
        assert torch.equal(loss, out[0][0]), "every rank holds the same loss after C0"
    emb_grad = vp.gather_rows([o[1] for o in out], part)
    head_grad = None if tied else vp.gather_rows([o[2] for o in out], part)
    for o in out:  # padding rows never get a gradient
        assert not o[1][part.shard_size:].any()
    r_last = p - 1
    assert not out[r_last][1][part.real_rows(r_last):].any()
    return out[0][0], emb_grad, head_grad, out[0][3]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_equals_unsplit_cross_entropy(p, tied):
    vocab = 11  # 2, 3 and 4 do not divide it: shards are padded
    case = _case(vocab, hidden=6, tied=tied, seed=p)
    want = _reference(*case, tied)
    got = _vocab_parallel(p, *case, tied)
    for name, a, b in zip(("loss", "embedding grad", "head grad", "body grad"), got, want):
        if b is None:
            continue
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-13), f"{name} differs at p={p}: {(a - b).abs().max()}"


def test_large_logits_stay_finite():
    """Each rank's own max keeps exp() in range where the unsplit logits reach 1e3."""
    case = _case(9, hidden=3, tied=False, seed=7)
    tokens, labels, emb, head, body = case
    head = head * 400.0
    want = _reference(tokens, labels, emb, head, body, False)
    got = _vocab_parallel(3, tokens, labels, emb, head, body, False)
    assert torch.isfinite(got[0])
    assert torch.allclose(got[0], want[0], rtol=1e-12)
    assert torch.allclose(got[2], want[2], rtol=1e-10, atol=1e-12)


def test_bfloat16_within_its_rounding():
    """bf16-mixed: products in bfloat16, softmax in float32, as the unsplit head and loss run them."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, 16, generator=g).to(torch.bfloat16)
    head = torch.randn(37, 16, generator=g).to(torch.bfloat16)
    labels = torch.randint(0, 37, (12,), generator=g)
    xr, wr = x.clone().requires_grad_(), head.clone().requires_grad_()
    want = F.cross_entropy((xr @ wr.T).float(), labels)
    want.backward()
    part, group = vp.partition_vocab(37, 2), ThreadAllReduce(2)

    def rank(r):
        shard, partials = vp.output_forward(x, vp.shard_rows(head, part, r), labels, part, r)
        assert shard.softmax.dtype == torch.float32
        stats = vp.reduce_output(partials, labels, group.for_rank(r), rank=r, ranks=2)
        tg = vp.mean_token_grad(labels)
        return ((stats.token_loss() * tg).sum(), vp.output_weight_grad(shard, stats, tg, dtype=torch.bfloat16),
                vp.output_input_grad(stats, tg, dtype=torch.bfloat16))

    out = _run_ranks(2, rank)
    assert out[0][1].dtype == torch.bfloat16 and out[0][2].dtype == torch.bfloat16
    assert torch.allclose(out[0][0], want.detach(), rtol=1e-3)
    assert torch.allclose(vp.gather_rows([o[1] for o in out], part).float(), wr.grad.float(), rtol=0.02, atol=2e-3)
    assert torch.allclose(out[0][2].float(), xr.grad.float(), rtol=0.02, atol=2e-3)



def test_c0_is_a_max_then_one_sum():
    """C0 runs two collectives on every rank: a MAX that gathers every rank's (m_r, e_r, t_r)
    ([p, 3, n]), then the SUM of the n x h values alpha_r.G_r - Y_r."""
    n, hidden, vocab, p = 6, 4, 13, 3
    case = _case(vocab, hidden, tied=False, seed=5)
    x = torch.randn(n, hidden, dtype=torch.float64)
    labels = case[1].reshape(-1)[:n]
    part, group = vp.partition_vocab(vocab, p), ThreadAllReduce(p)
    calls: list[list] = [[] for _ in range(p)]

    def rank(r):
        inner = group.for_rank(r)

        def counted(tensor, op):
            calls[r].append((op, tuple(tensor.shape)))
            inner(tensor, op)

        _, partials = vp.output_forward(x, vp.shard_rows(case[3], part, r), labels, part, r)
        return vp.reduce_output(partials, labels, counted, rank=r, ranks=p)

    _run_ranks(p, rank)
    assert calls == [[("max", (p, 3, n)), ("sum", (n, hidden))]] * p

def test_partition_pads_and_says_so():
    part = vp.partition_vocab(10, 4)
    assert [part.rows(r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert part.padding == 2 and "V = 10" in part.note() and "p = 4" in part.note()
    assert vp.partition_vocab(12, 4).note() is None
    table = torch.arange(20.0).reshape(10, 2)
    shards = [vp.shard_rows(table, part, r) for r in range(4)]
    assert shards[3].shape == (3, 2) and not shards[3][1:].any()
    assert torch.equal(vp.gather_rows(shards, part), table)


def test_partition_refuses_a_rank_without_rows():
    with pytest.raises(ValueError, match=r"V = 5 .* \[3\] of p = 4 .* at least 7"):
        vp.partition_vocab(5, 4)
    with pytest.raises(ValueError, match="expected \\(3, 2\\)"):
        vp.output_forward(torch.zeros(1, 2), torch.zeros(2, 2), torch.zeros(1, dtype=torch.long),
                          vp.partition_vocab(10, 4), 0)


def _head_grads(x, head, labels, p, *, drop_rescale=False):
    """dL/dX and dL/dW of the vocabulary-parallel head over p threaded ranks (x in the compute
    dtype, the head a float32 master as under bf16-mixed); `drop_rescale`: a deliberately wrong
    C0 that forgets each rank's exp(m_r - M) (every rank's softmax taken as the global one)."""
    part = vp.partition_vocab(head.shape[0], p)
    group = ThreadAllReduce(p)

    def rank(r):
        shard, partials = vp.output_forward(x, vp.shard_rows(head, part, r), labels, part, r)
        if drop_rescale:
            partials = vp.OutputPartials(torch.zeros_like(partials.local_max), torch.ones_like(partials.local_sum),
                                         partials.target_logit, partials.softmax_input_grad, partials.target_rows)
        stats = vp.reduce_output(partials, labels, group.for_rank(r), rank=r, ranks=p)
        g = vp.mean_token_grad(labels)
        return vp.output_input_grad(stats, g), vp.output_weight_grad(shard, stats, g, dtype=torch.float32)

    out = _run_ranks(p, rank)
    return {"x": out[0][0], "head": vp.gather_rows([o[1] for o in out], part)}


def _unsplit_head_grads(x, head, labels):
    x, head = x.detach().clone().requires_grad_(), head.detach().clone().requires_grad_()
    F.cross_entropy((x @ head.T).float(), labels).backward()
    return {"x": x.grad, "head": head.grad}


def test_bf16_vocab_parallel_is_as_close_to_float64_as_one_process():
    """Under bf16-mixed the sharded head rounds elsewhere than one process's bfloat16 head, so
    `train --verify` judges both against float64 (`reference.excess_error`): the products run in
    bfloat16 (the float32 master shard rounded, as one process's compute copy is) and the result
    is within one process's own rounding noise; a C0 without the rescaling is far outside it."""
    from pipeblocks.train.reference import TOLERANCE, excess_error

    g = torch.Generator().manual_seed(0)
    n, hidden, vocab = 64, 16, 1000
    x = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.2
    labels = torch.randint(0, vocab, (n,), generator=g)
    truth = _unsplit_head_grads(x, head, labels)
    one_process = _unsplit_head_grads(x.bfloat16(), head.bfloat16(), labels)
    got = _head_grads(x.bfloat16(), head.float(), labels, p=4)
    assert got["x"].dtype == torch.float32 and got["head"].dtype == torch.float32
    judged = excess_error(got, one_process, truth)
    assert judged.relative <= TOLERANCE["bf16-mixed"], judged
    # the products ran in bfloat16, not in the master's float32: the shard kept for T is bfloat16
    part = vp.partition_vocab(vocab, 4)
    shard, _ = vp.output_forward(x.bfloat16(), vp.shard_rows(head.float(), part, 0), labels, part, 0)
    assert shard.x.dtype == torch.bfloat16 and shard.softmax.dtype == torch.float32
    wrong = excess_error(_head_grads(x.bfloat16(), head.float(), labels, p=4, drop_rescale=True), one_process, truth)
    assert wrong.relative > 10 * TOLERANCE["bf16-mixed"], wrong
