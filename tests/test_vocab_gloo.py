"""The vocabulary passes on torch.distributed: lowered Programs run by p gloo processes,
X and the embedding gradient point to point, C0 and IF's reduction on their own process
groups from worker threads (`runtime.vocab_link.DistVocabLink`); the loss and every
gradient equal one process on the unsplit tables in float64."""
from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch

from _vocab_cases import H, N, make_case, reference, run_rank
from pipeblocks.core.ir.vocab import roots
from pipeblocks.runtime.vocab_parallel import gather_rows, partition_vocab, shard_rows

pytestmark = pytest.mark.spawn

CASES = [("1f1b", 2, 4, False), ("zb-v", 2, 4, True), ("v-half", 4, 8, False)]


class DistMailbox:
    """The stages' transfers: isend / recv tagged by (payload, producing stage, microbatch)."""

    def __init__(self, num_stages: int) -> None:
        self.num_stages, self.sends = num_stages, []

    def _tag(self, key) -> int:
        payload, producer, mb, _ = key
        return (mb * self.num_stages + producer) * 2 + (payload == "B")

    def put(self, key, value, peer) -> None:
        import torch.distributed as dist

        self.sends.append(dist.isend(value.contiguous(), dst=peer, tag=self._tag(key)))

    def take(self, key, peer):
        import torch.distributed as dist

        out = torch.empty(N, H, dtype=torch.float64)
        dist.recv(out, src=peer, tag=self._tag(key))
        return out

    def close(self) -> None:
        for handle in self.sends:
            handle.wait()


def _worker(rank, world, init_file, folder):
    import torch.distributed as dist

    from pipeblocks.runtime.vocab_exec import VocabRank, VocabTables
    from pipeblocks.runtime.vocab_link import DistVocabLink

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        for name, p, m, tied in CASES:
            case = make_case(name, p, m, tied)
            schedule = case.program.schedule
            first, last = roots(schedule)
            # every process takes part in creating the groups, members or not
            group = dist.new_group(list(range(p)))
            link = DistVocabLink(list(range(p)), (N, H), torch.float64, first=first, last=last)
            if rank >= p:
                link.close()
                continue
            part = partition_vocab(case.embedding.shape[0], p)
            emb = shard_rows(case.embedding, part, rank)
            tables = VocabTables(emb, emb if tied else shard_rows(case.head, part, rank))
            vocab = VocabRank(rank, part, tables, link, tokens=case.tokens, labels=case.labels, first=first,
                              last=last, scale=1.0 / m)
            mailbox = DistMailbox(schedule.num_stages)
            run_rank(rank, case.program.ranks[rank], case.stages, vocab, mailbox, schedule.num_stages - 1)
            mailbox.close()
            losses = vocab.losses()
            link.close()
            mine = [s for s in range(schedule.num_stages) if schedule.placement.stage_to_rank[s] == rank]
            torch.save({"loss": sum(losses), "embedding": tables.embedding.grad, "head": tables.head.grad,
                        "stages": {s: [q.grad for q in case.stages[s].parameters()] for s in mine}},
                       os.path.join(folder, f"{name}-{rank}.pt"))
            dist.barrier(group)
    finally:
        dist.destroy_process_group()


def test_vocab_programs_on_gloo_match_one_process():
    import torch.multiprocessing as mp

    world = max(p for _, p, _, _ in CASES)
    with tempfile.TemporaryDirectory() as folder:
        context = mp.spawn(_worker, args=(world, os.path.join(folder, "init"), folder), nprocs=world, join=False)
        waited = 0.0
        while not context.join(timeout=5):
            waited += 5
            if waited >= 90:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                pytest.fail("the gloo run did not finish in 90 s")
        for name, p, m, tied in CASES:
            case = make_case(name, p, m, tied)
            loss, emb_grad, head_grad, ref_stages = reference(case, tied)
            got = [torch.load(os.path.join(folder, f"{name}-{r}.pt")) for r in range(p)]
            part = partition_vocab(case.embedding.shape[0], p)
            for r in range(p):
                torch.testing.assert_close(got[r]["loss"], loss, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(gather_rows([g["embedding"] for g in got], part), emb_grad,
                                       rtol=1e-12, atol=1e-14)
            if not tied:
                torch.testing.assert_close(gather_rows([g["head"] for g in got], part), head_grad,
                                           rtol=1e-12, atol=1e-14)
            stages = {s: grads for g in got for s, grads in g["stages"].items()}
            assert sorted(stages) == list(range(len(ref_stages)))
            for s, ref in enumerate(ref_stages):
                for mine, want in zip(stages[s], ref.parameters()):
                    torch.testing.assert_close(mine, want.grad, rtol=1e-12, atol=1e-14)
