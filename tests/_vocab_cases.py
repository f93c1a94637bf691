"""Shared by the vocabulary runtime tests: a toy pipeline (each stage a float64 linear
layer and tanh; the embedding and head tables of V rows), a rank's walk over its ops of a
lowered Program, and the one-process reference on the unsplit tables."""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeblocks import schedules
from pipeblocks.core.ir.actions import Action, Kind
from pipeblocks.core.cost.costs import Costs
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.simulator.simulate import simulate_program
from pipeblocks.core.ir.ops import Comm
from pipeblocks.core.ir.program import Program
from pipeblocks.core.ir.vocab import VocabCosts, VocabPass
from pipeblocks.runtime.vocab_exec import VocabRank

TIMEOUT = 30.0
V, H, N = 11, 4, 3  # vocabulary (not divisible by 2 or 4: padded shards), width, tokens per microbatch
COSTS = Costs(t_f=1.0, t_b=1.0, t_w=1.0, vocab=VocabCosts(t_s=0.3, t_t=0.2, t_if=0.05, t_ib=0.05, t_bcast=0.05,
                                                           t_c0=0.1, t_if_reduce=0.02, t_ib_bcast=0.02))


@dataclass
class Case:
    program: Program
    embedding: torch.Tensor
    head: torch.Tensor
    tokens: list
    labels: list
    stages: list


def make_case(name: str, p: int, m: int, tied: bool) -> Case:
    """The same on every process: the Program and data drawn from fixed seeds."""
    program = lower_for(schedules.get(name)(p=p, m=m), vocab=COSTS, check=True, simulate=simulate_program)
    torch.manual_seed(0)
    embedding = torch.randn(V, H, dtype=torch.float64)
    head = embedding if tied else torch.randn(V, H, dtype=torch.float64)
    tokens = [torch.randint(0, V, (N,)) for _ in range(m)]
    labels = [torch.randint(0, V, (N,)) for _ in range(m)]
    labels[1][0] = -100  # an ignored label
    stages = [_stage(s) for s in range(program.schedule.num_stages)]
    return Case(program, embedding, head, tokens, labels, stages)


def reference(case: Case, tied: bool):
    """(loss, embedding grad, head grad, stage modules with their grads) of one process."""
    m = len(case.tokens)
    stages = copy.deepcopy(case.stages)
    emb = case.embedding.clone().requires_grad_(True)
    head = emb if tied else case.head.clone().requires_grad_(True)
    loss = 0.0
    for i in range(m):
        x = emb[case.tokens[i]]
        for stage in stages:
            x = stage(x)
        loss = loss + F.cross_entropy(x @ head.T, case.labels[i]) / m
    loss.backward()
    return loss.detach(), emb.grad, head.grad, stages


class Mailbox:
    """Point-to-point tensors by key; a receive blocks until its send."""

    def __init__(self) -> None:
        self.items: dict = {}
        self.cond = threading.Condition()

    def put(self, key, value, peer=None) -> None:
        with self.cond:
            self.items[key] = value
            self.cond.notify_all()

    def take(self, key, peer=None):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.items, TIMEOUT):
                raise TimeoutError(f"nothing sent under {key}: the Program deadlocks")
            return self.items.pop(key)


class Collective:
    """All-reduces of one kind over p threads: the k-th call of every rank meets the others'
    k-th; sums in rank order, so every rank gets the same bits."""

    def __init__(self, p: int) -> None:
        self.p, self.cond, self.calls, self.parts = p, threading.Condition(), {}, {}

    def all_reduce(self, rank: int):
        def reduce(tensor: torch.Tensor, op: str) -> None:
            with self.cond:
                k = self.calls[rank] = self.calls.get(rank, -1) + 1
                self.parts.setdefault(k, {})[rank] = tensor.clone()
                self.cond.notify_all()
                if not self.cond.wait_for(lambda: len(self.parts[k]) == self.p, TIMEOUT):
                    raise TimeoutError(f"all-reduce {k}: only ranks {sorted(self.parts[k])} arrived")
                parts = [self.parts[k][r] for r in range(self.p)]
            out = parts[0].clone()
            for x in parts[1:]:
                out = torch.maximum(out, x) if op == "max" else out + x
            tensor.copy_(out)
        return reduce


class ThreadLink:
    def __init__(self, rank: int, mailbox: Mailbox, collectives: dict, workers: dict) -> None:
        self.rank, self.mailbox, self.collectives, self.workers = rank, mailbox, collectives, workers

    def send(self, tensor, dst, key) -> None:
        self.mailbox.put(("vocab", key), tensor)

    def recv(self, key):
        return self.mailbox.take(("vocab", key))

    def issue(self, kind, work):
        return self.workers[kind].submit(work, self.collectives[kind].all_reduce(self.rank))


def run_rank(rank, ops, stages, vocab: VocabRank, mailbox: Mailbox, last: int) -> None:
    inputs, outputs, grads = {}, {}, {}
    for op in ops:
        if type(op) is VocabPass:
            vocab.run(op)
        elif type(op) is Comm:
            if op.send:
                value = outputs[op.stage, op.microbatch] if op.payload == "F" else grads[op.stage - 1, op.microbatch]
                mailbox.put(op.key, value.detach(), op.peer)
            else:
                value = mailbox.take(op.key, op.peer)
                if op.payload == "F":
                    inputs[op.stage, op.microbatch] = value
                else:
                    grads[op.stage, op.microbatch] = value
        elif type(op) is Action:
            s, i = op.stage, op.microbatch
            if op.kind is Kind.F:
                source = vocab.embedding_output(i) if s == 0 else inputs.pop((s, i), None)
                if source is None:
                    source = outputs[s - 1, i]  # the neighbour stage on this rank (the turn of a V)
                leaf = source.detach().requires_grad_(True)
                out = stages[s](leaf)
                inputs[s, i] = leaf
                outputs[s, i] = out
                if s == last:
                    vocab.after_last_forward(i, out)
            elif op.kind in (Kind.B, Kind.BW):
                grad = vocab.last_output_grad(i) if s == last else grads.pop((s, i))
                leaf = inputs.pop((s, i))
                torch.autograd.backward(outputs[s, i], grad)
                if s == 0:
                    vocab.after_first_backward(i, leaf.grad)
                else:
                    grads[s - 1, i] = leaf.grad
            # W: the backward above already accumulated the weight gradients
        else:
            raise AssertionError(f"op {op} in a test Program")


def _stage(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh()).double()
