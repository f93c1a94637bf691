"""Vocabulary parallelism's numerics on two gloo processes equal the unsplit head and loss in float64."""
from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.spawn

VOCAB, HIDDEN = 7, 5  # 2 does not divide 7: rank 1's shard ends in a padding row


def _data():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (6,), generator=g)
    labels = torch.randint(0, VOCAB, (6,), generator=g)
    labels[2] = -100
    emb = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    return tokens, labels, emb, head


def _worker(rank, world, init_file, folder):
    import torch.distributed as dist

    from pipeblocks.runtime import vocab_parallel as vp

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        all_reduce = vp.process_group_all_reduce()
        tokens, labels, emb, head = _data()
        part = vp.partition_vocab(VOCAB, world)
        emb_shard, head_shard = vp.shard_rows(emb, part, rank), vp.shard_rows(head, part, rank)
        h0 = vp.embedding_forward(tokens, emb_shard, part, rank, all_reduce).requires_grad_()   # IF
        x = torch.sin(h0)                                                                     # the stages
        shard, partials = vp.output_forward(x.detach(), head_shard, labels, part, rank)       # S
        stats = vp.reduce_output(partials, labels, all_reduce, rank=rank, ranks=world)      # C0
        g = vp.mean_token_grad(labels, dtype=torch.float64)
        x.backward(vp.output_input_grad(stats, g))
        torch.save({"loss": (stats.token_loss() * g).sum(),
                    "head": vp.output_weight_grad(shard, stats, g),                          # T
                    "emb": vp.embedding_weight_grad(tokens, h0.grad, part, rank)},           # IB
                   os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_equal_cross_entropy():
    import torch.multiprocessing as mp

    from pipeblocks.runtime import vocab_parallel as vp

    with tempfile.TemporaryDirectory() as folder:
        context = mp.spawn(_worker, args=(2, os.path.join(folder, "init"), folder), nprocs=2, join=False)
        waited = 0
        while not context.join(timeout=5):
            waited += 5
            if waited >= 60:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                pytest.fail("the gloo ranks did not finish in 60 s")
        got = [torch.load(os.path.join(folder, f"rank{r}.pt")) for r in range(2)]
    tokens, labels, emb, head = _data()
    emb, head = emb.requires_grad_(), head.requires_grad_()
    loss = F.cross_entropy(torch.sin(F.embedding(tokens, emb)) @ head.T, labels)
    loss.backward()
    part = vp.partition_vocab(VOCAB, 2)
    for r in range(2):
        torch.testing.assert_close(got[r]["loss"], loss.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(vp.gather_rows([x["head"] for x in got], part), head.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(vp.gather_rows([x["emb"] for x in got], part), emb.grad, rtol=1e-12, atol=1e-14)
