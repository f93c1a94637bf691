"""The executor's receive posting, in one process with a recording mailbox: every receive is
posted exactly once, in the plan's order, and a rank that would block on a receive posts the
receives of its next pass before waiting (not between the hand-over and that pass)."""
from __future__ import annotations

import pytest
import torch

from pipeblocks import schedules
from pipeblocks.core.ir.actions import Action
from pipeblocks.core.ir.ops import Comm
from pipeblocks.core.lowering.validate import validate
from pipeblocks.runtime.backward import WeightGradWork
from pipeblocks.runtime.comm import receive_posts
from pipeblocks.runtime.compute import Unit
from pipeblocks.runtime.executor import RankExecutor
from pipeblocks.runtime.shapes import TensorSpec

pytestmark = pytest.mark.torch


class RecordingMailbox:
    """Receives complete when waited for; `log` holds ("post", key), ("wait", key) and ("compute", None)."""

    def __init__(self, arrived: bool) -> None:
        self.log: list[tuple[str, tuple | None]] = []
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._arrived = arrived

    def send(self, tensor, peer, tag, label) -> None:
        pass

    def recv(self, key, buffer, peer, tag) -> None:
        self.log.append(("post", key))
        self._buffers[key] = buffer

    def flush(self) -> None:
        pass

    def arrived(self, key) -> bool:
        return self._arrived

    def wait(self, key, label):
        self.log.append(("wait", key))
        return self._buffers.pop(key)

    def finish(self) -> None:
        pass


class NoCompute:
    def __init__(self, mailbox: RecordingMailbox, activation: torch.Tensor, last: int) -> None:
        self.mailbox, self.activation, self.last = mailbox, activation, last

    def forward(self, stage, x, target):
        self.mailbox.log.append(("compute", None))
        return (None, Unit(x, x, loss=torch.zeros(()))) if stage == self.last else (self.activation, Unit(x, x))

    def input_grad(self, stage, unit, grad):
        self.mailbox.log.append(("compute", None))
        unit.root = unit.inp = None
        unit.work = WeightGradWork([])
        return self.activation if stage > 0 else None

    def weight_grad(self, stage, unit) -> None:
        self.mailbox.log.append(("compute", None))
        unit.work = None

    def full_backward(self, stage, unit, grad):
        self.mailbox.log.append(("compute", None))
        unit.root = unit.inp = None
        return self.activation if stage > 0 else None


def run_rank(name: str, rank: int, *, arrived: bool, p: int = 4, m: int = 8) -> tuple[list, dict]:
    schedule = schedules.get(name)(p=p, m=m)
    program = validate(schedule)
    activation = torch.zeros(2, 3)
    spec = TensorSpec.of(activation)
    specs, out_specs = {}, {}
    for stage in schedule.placement.stages_of(rank):
        for mb in range(m):
            specs[("F", stage - 1, mb, 0)] = specs[("B", stage + 1, mb, 0)] = out_specs[(stage, mb, 0)] = spec
    mailbox = RecordingMailbox(arrived)
    executor = RankExecutor(program, rank, NoCompute(mailbox, activation, schedule.num_stages - 1), mailbox,
                            torch.device("cpu"), specs, out_specs)
    tokens = [torch.zeros(2, 3, dtype=torch.long)] * m
    executor.run(tokens, tokens)
    return mailbox.log, receive_posts(program, rank)


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "interleaved-1f1b"])
def test_every_receive_is_posted_once_in_plan_order(name):
    for rank in range(4):
        for arrived in (True, False):
            log, plan = run_rank(name, rank, arrived=arrived)
            posted = [key for what, key in log if what == "post"]
            assert posted == [r.key for index in sorted(plan) for r in plan[index]], f"rank {rank}, arrived={arrived}"


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_a_rank_that_would_block_posts_its_next_pass_receives_first(name):
    rank = 1
    program = validate(schedules.get(name)(p=4, m=8))
    ops = program.ranks[rank]
    blocked, landed = run_rank(name, rank, arrived=False)[0], run_rank(name, rank, arrived=True)[0]
    plan = receive_posts(program, rank)
    checked = 0
    for i, op in enumerate(ops):
        if not (isinstance(op, Comm) and not op.send):
            continue
        j = next(k for k in range(i + 1, len(ops)) if isinstance(ops[k], Action))
        due = [r.key for k in range(i + 1, j + 1) for r in plan.get(k, ())]  # posted before the next pass
        for key in due:
            checked += 1
            # idle on op's receive: the next pass's receives go out before the wait, not after it
            assert blocked.index(("post", key)) < blocked.index(("wait", op.key))
            # a receive that has landed is no reason to post early
            assert landed.index(("post", key)) > landed.index(("wait", op.key))
    assert checked > 0, "the schedule has receives due right after a waited one"
