"""A rank's VocabStage, run by p threads as a tiny pipeline, equals one process's embedding, head and loss."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from pipeblocks.runtime.vocab_parallel import gather_rows, partition_vocab
from pipeblocks.runtime.vocab_stage import VocabStage

pytestmark = pytest.mark.torch

VOCAB, HIDDEN, M = 13, 6, 2


class Threads:
    """In-place all-reduce and broadcast among p threads."""

    def __init__(self, p: int) -> None:
        self.slots: list = [None] * p
        self.barrier = threading.Barrier(p, timeout=30)

    def all_reduce(self, rank):
        def run(tensor, op):
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            stack = torch.stack(self.slots)
            result = stack.sum(0) if op == "sum" else stack.amax(0)
            self.barrier.wait()
            tensor.copy_(result)
        return run

    def broadcast(self, rank):
        def run(tensor, src):
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            result = self.slots[src]
            self.barrier.wait()
            tensor.copy_(result)
        return run


def _data(tied):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (M, 2, 3), generator=g)
    labels = torch.randint(0, VOCAB, (M, 2, 3), generator=g)
    labels[1, 0, 2] = -100
    emb = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    head = None if tied else torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    body = torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64)
    return tokens, labels, emb, head, body


def _reference(tokens, labels, emb, head, body):
    emb, body = emb.clone().requires_grad_(), body.clone().requires_grad_()
    out = emb if head is None else head.clone().requires_grad_()
    loss = sum(F.cross_entropy((torch.tanh(F.embedding(t, emb) @ body) @ out.T).reshape(-1, VOCAB), y.reshape(-1))
               for t, y in zip(tokens, labels)) / M
    loss.backward()
    return loss.detach(), emb.grad, None if head is None else out.grad, body.grad


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("p", [2, 3])
def test_stage_passes_equal_one_process(p, tied):
    tokens, labels, emb, head, body = _data(tied)
    part, group = partition_vocab(VOCAB, p), Threads(p)
    first, last = 0, p - 1
    to_last, to_first = queue.Queue(), queue.Queue()
    body_grads, losses = [], {}

    def rank(r):
        stage = VocabStage.from_tables(emb, head, part, r, first_rank=first, last_rank=last,
                                       all_reduce=group.all_reduce(r), broadcast=group.broadcast(r))
        w = body.clone().requires_grad_() if r == first else None
        h0, x = {}, {}
        for mb in range(M):                                   # IF0 IF1
            h0[mb] = stage.input_forward(mb, tokens[mb])
            if r == first:                                    # stage 0's forward, sent to the last stage
                h0[mb].requires_grad_()
                x[mb] = torch.tanh(h0[mb] @ w)
                to_last.put(x[mb].detach())
        for mb in range(M):                                   # S0 S1
            stage.output_forward(mb, to_last.get() if r == last else None, labels[mb])
            losses.setdefault(r, []).append(stage.loss(mb))
        for mb in reversed(range(M)):                         # T1 T0, and the last stage's backward
            if r == last:
                to_first.put(stage.output_input_grad(mb, 1 / M))
            stage.output_backward(mb, 1 / M)
        dh0 = {}
        if r == first:
            for mb in reversed(range(M)):
                x[mb].backward(to_first.get())
                dh0[mb] = h0[mb].grad
            body_grads.append(w.grad)
        for mb in reversed(range(M)):                         # IB1 IB0
            stage.input_backward(mb, dh0.get(mb))
        assert stage.pending() == ([], [])
        return stage, stage.gather_tables()

    with ThreadPoolExecutor(max_workers=p) as pool:
        stages, tables = zip(*[f.result() for f in [pool.submit(rank, r) for r in range(p)]])
    want_loss, want_emb, want_head, want_body = _reference(tokens, labels, emb, head, body)
    for r in range(p):
        torch.testing.assert_close(sum(losses[r]) / M, want_loss, rtol=1e-12, atol=0)
    for embedding, out in tables:  # every rank gets the whole tables back, padding dropped
        assert torch.equal(embedding, emb) and (out is None if tied else torch.equal(out, head))
    torch.testing.assert_close(gather_rows([s.embedding.grad for s in stages], part), want_emb, rtol=1e-12, atol=1e-14)
    if not tied:
        torch.testing.assert_close(gather_rows([s.head.grad for s in stages], part), want_head, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(body_grads[0], want_body, rtol=1e-12, atol=1e-14)


def test_roots_must_give_their_tensors_and_shards_must_fit():
    part = partition_vocab(VOCAB, 2)
    noop = lambda tensor, arg: None  # noqa: E731 (a one-rank stand-in for both collectives)
    stage = VocabStage.from_tables(torch.zeros(VOCAB, HIDDEN), None, part, 1, first_rank=0, last_rank=1,
                                   all_reduce=noop, broadcast=noop)
    with pytest.raises(ValueError, match="S0 on rank 1, the last stage's: give its output"):
        stage.output_forward(0, None, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"7 rows, the split gives each rank 5 \(V = 13, p = 3\)"):
        VocabStage(partition_vocab(VOCAB, 3), 0, embedding=torch.nn.Parameter(torch.zeros(7, 2)), head=None,
                   first_rank=0, last_rank=2, all_reduce=noop, broadcast=noop)
