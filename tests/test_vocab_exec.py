"""The vocabulary passes of lowered Programs, run: p ranks as threads in one process, each
walking its rank's ops in order (stage actions, transfers, IF/S/T/IB through
`runtime.vocab_exec.VocabRank`), with blocking receives and collectives that complete only
when every rank has issued them. Every Program finishes (no deadlock under the real
semantics), and the loss and every gradient equal one process running the unsplit model,
in float64."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from _vocab_cases import TIMEOUT, V, Collective, Mailbox, ThreadLink, make_case, reference, run_rank
from pipeblocks.core.ir.vocab import roots
from pipeblocks.runtime.vocab_exec import VocabRank, VocabTables
from pipeblocks.runtime.vocab_parallel import gather_rows, partition_vocab, shard_rows

pytestmark = pytest.mark.torch


@pytest.mark.parametrize("name,p,m,tied", [
    ("1f1b", 2, 3, False), ("zb-v", 2, 4, True), ("1f1b", 4, 5, False), ("v-half", 4, 8, False),
])
def test_vocab_program_runs_and_is_exact(name, p, m, tied):
    case = make_case(name, p, m, tied)
    program, schedule = case.program, case.program.schedule
    S = schedule.num_stages
    embedding, head, tokens, labels, stages = case.embedding, case.head, case.tokens, case.labels, case.stages
    loss, ref_emb_grad, ref_head_grad, ref_stages = reference(case, tied)

    part = partition_vocab(V, p)
    first, last_rank = roots(schedule)
    mailbox = Mailbox()
    collectives = {"C0": Collective(p), "IF": Collective(p)}
    tables, ranks = [], []
    pools = []
    for r in range(p):
        emb = shard_rows(embedding, part, r)
        tables.append(VocabTables(emb, emb if tied else shard_rows(head, part, r)))
        workers = {kind: ThreadPoolExecutor(1) for kind in collectives}
        pools.extend(workers.values())
        link = ThreadLink(r, mailbox, collectives, workers)
        ranks.append(VocabRank(r, part, tables[r], link, tokens=tokens, labels=labels, first=first, last=last_rank,
                               scale=1.0 / m, timeout=TIMEOUT))
    with ThreadPoolExecutor(p) as pool:
        futures = [pool.submit(run_rank, r, program.ranks[r], stages, ranks[r], mailbox, S - 1) for r in range(p)]
        for f in futures:
            f.result(2 * TIMEOUT)
    for w in pools:
        w.shutdown()

    assert sum(ranks[0].losses()).item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-14)
    assert all(torch.equal(sum(ranks[r].losses()), sum(ranks[0].losses())) for r in range(p))
    grad_emb = gather_rows([t.embedding.grad for t in tables], part)
    torch.testing.assert_close(grad_emb, ref_emb_grad, rtol=1e-12, atol=1e-14)
    if not tied:
        torch.testing.assert_close(gather_rows([t.head.grad for t in tables], part), ref_head_grad,
                                   rtol=1e-12, atol=1e-14)
    for mine, ref in zip(stages, ref_stages):
        for a, b in zip(mine.parameters(), ref.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-14)
