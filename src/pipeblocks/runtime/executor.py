"""Runs one rank's lowered Program for one step.

The executor walks `program.ranks[rank]` in order and knows nothing about schedules:

    Action F    take the input (step input on stage 0, a received or locally handed-over
                activation otherwise), run the forward, hand the output on
    Action B    take the output gradient (received, handed over, or the loss), compute the
                input gradient, hand it on; what W needs stays in the unit
    Action W    weight gradients of that unit
    Action BW   fused backward
    Comm RECV   wait for the receive (posted earlier by the plan in comm.py)
    Comm SEND   queue an isend of the tensor the previous action produced
    DPOp        UNSHARD / RESHARD / REDUCE_GRAD, handed to the rank's `DataParallel`
                (data_parallel.py), which launches them without waiting; every compute
                action first lets it wait for what the action's stage needs
    Recompute   re-run the forward of a unit whose F ran without its graph (the F of
                every unit the Program recomputes does), just before its backward
    STEP        an optimizer step inside the Program (asynchronous training): handed to
                the compute object's `optimizer_step(stage, step)`; only a compute object
                that has that method runs a Program with steps

With sequence chunks (schedule.seq_chunks = k > 1) the step's inputs and targets come cut
into m*k units (index microbatch*k + chunk) and each forward gets the unit's
`SequenceChunk` from `chunks` (sequence.py).

Two stages of one rank that are neighbours (the turn of a V) hand over through a dict:
the Program has no comm op for them. Unknown op types raise, naming the op.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..core.actions import Action, Kind
from ..core.ops import ACTION, DP, P2P, RECOMPUTE, STEP, require_known
from ..core.program import Comm, DPOp, OptimizerStep, Program, Recompute
from ..core.recompute import recompute_units
from .comm import Mailbox, Tags, receive_posts
from .compute import Unit
from .sequence import SequenceChunk
from .shapes import SpecMismatchError, TensorSpec

__all__ = ["RankExecutor", "RankRecord", "ActionError"]

_COMPUTE, _SEND, _RECV, _DP, _RECOMPUTE, _STEP = "compute", "send", "recv", "dp", "recompute", "step"  # plan op codes


class ActionError(RuntimeError):
    """A compute action raised; the message names the rank, the action and the input spec."""


@dataclass(frozen=True)
class RankRecord:
    """What one rank measured in one step (times from `clock`, in seconds)."""

    events: tuple[tuple[Action | Recompute, float, float], ...]
    losses: tuple[float, ...]
    wait_s: float


class RankExecutor:
    """Executes `program.ranks[rank]`; `specs` maps every received key to its TensorSpec and
    `out_specs[(stage, mb, chunk)]` is what this rank's stages must send on; `chunks` maps
    (stage, mb, chunk) to its SequenceChunk when the schedule has sequence chunks."""

    def __init__(
        self,
        program: Program,
        rank: int,
        compute,
        mailbox: Mailbox,
        device: torch.device,
        specs: dict[tuple, TensorSpec],
        out_specs: dict[tuple[int, int, int], TensorSpec],
        clock: Callable[[], float] = time.perf_counter,
        chunks: dict[tuple[int, int, int], SequenceChunk] | None = None,
        data_parallel=None,
    ) -> None:
        schedule = program.schedule
        self.ops = program.ranks[rank]
        self.rank = rank
        self.last = schedule.num_stages - 1
        self.m = schedule.m
        self.compute = compute
        self.mailbox = mailbox
        self.device = device
        self.specs = specs
        self.out_specs = out_specs
        self.clock = clock
        self.chunks = chunks
        self.k = schedule.seq_chunks
        self.tags = Tags(schedule.num_stages, schedule.m, schedule.seq_chunks)
        self.posts = receive_posts(program, rank)
        self.dp = data_parallel
        self.recomputed = recompute_units(self.ops)
        if self.recomputed and schedule.seq_chunks > 1:
            raise ValueError(
                f"rank {rank}: the runtime does not recompute sequence chunks (schedule {schedule.name!r} has "
                f"{schedule.seq_chunks}): a chunk's recomputation would append its K/V twice; drop the "
                "recomputation or the sequence chunks"
            )
        known = (ACTION, P2P, RECOMPUTE) + ((DP,) if data_parallel else ())
        known += (STEP,) if hasattr(compute, "optimizer_step") else ()
        require_known(self.ops, f"the runtime (rank {rank})", known)
        self._plan = self._compile()

    def _compile(self) -> list[tuple]:
        """Per op, everything the step loop needs that does not change between steps: the
        receives to post (key, spec, peer, tag), the op's key, peer, tag (for a receive: the
        index of the pass after it) and error label. At a few milliseconds per pass every
        microsecond between two passes is bubble, so the loop looks nothing up and formats
        no text."""
        plan = []
        next_compute = len(self.ops) - 1
        for index in reversed(range(len(self.ops))):
            op = self.ops[index]
            posts = tuple((r.key, self.specs[r.key], r.peer, self.tags.data(r.key)) for r in self.posts.get(index, ()))
            if isinstance(op, Action):
                next_compute = index
                plan.append((posts, _COMPUTE, op, None, 0, 0, None))
            elif type(op) is DPOp:
                plan.append((posts, _DP, op, None, 0, 0, None))
            elif type(op) is Recompute:
                plan.append((posts, _RECOMPUTE, op, op.unit, 0, 0, None))
            elif type(op) is OptimizerStep:
                plan.append((posts, _STEP, op, None, 0, 0, None))
            elif op.send:
                expected = self.out_specs[(op.stage, op.microbatch, op.seq_chunk or 0)] if op.payload == "F" else None
                plan.append((posts, _SEND, op, op.key, op.peer, self.tags.data(op.key), (str(op), expected)))
            else:
                plan.append((posts, _RECV, op, op.key, op.peer, next_compute, f"{op} from rank {op.peer}"))
        plan.reverse()
        return plan

    def run(self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None) -> RankRecord:
        ready: dict[tuple, torch.Tensor] = {}  # activations/gradients handed to a local consumer or a SEND
        units: dict[tuple, Unit] = {}
        losses: dict[int, float] = {}
        events: list[tuple[Action, float, float]] = []
        wait_s = 0.0
        mailbox, clock, device, plan = self.mailbox, self.clock, self.device, self._plan
        posted = -1  # the receives of every op up to this index are posted
        for index, (posts, code, op, key, peer, tag, extra) in enumerate(plan):
            if index > posted:
                for recv_key, spec, recv_peer, recv_tag in posts:
                    mailbox.recv(recv_key, spec.empty(device), recv_peer, recv_tag)
                posted = index
            if code is _SEND:
                tensor = ready.pop(key)
                label, expected = extra
                if expected is not None:
                    self._check_sent(op, tensor, expected)
                mailbox.send(tensor, peer, tag, label)
                continue
            if code is _RECV:
                if not mailbox.arrived(key):
                    # Idle until the transfer lands: post the receives due before the next pass
                    # now, so that their cost is not paid between the hand-over and that pass.
                    for ahead in range(posted + 1, tag + 1):
                        for recv_key, spec, recv_peer, recv_tag in plan[ahead][0]:
                            mailbox.recv(recv_key, spec.empty(device), recv_peer, recv_tag)
                    posted = max(posted, tag)
                start = clock()
                ready[key] = mailbox.wait(key, extra)
                wait_s += clock() - start
                continue
            if code is _DP:
                mailbox.flush()  # a collective may block: the pipeline peers get their tensors first
                self.dp.run(op)
                continue
            if code is _STEP:
                mailbox.flush()  # the peers get this rank's tensors before the step's compute
                self.compute.optimizer_step(op.stage, op.step)
                continue
            mailbox.flush()
            if self.dp is not None:
                self.dp.before_compute(op.stage)
            start = clock()
            try:
                if code is _RECOMPUTE:
                    self.compute.recompute(op.stage, units[key])
                else:
                    self._compute(op, ready, units, losses, inputs, targets)
            except (SpecMismatchError, ActionError):
                raise
            except Exception as err:
                raise ActionError(f"rank {self.rank}, action {op}: {type(err).__name__}: {err}") from err
            events.append((op, start, clock()))
        start = clock()
        mailbox.finish()
        wait_s += clock() - start
        leftover = [k for k, u in units.items() if u.root is not None or u.work is not None or u.kept is not None]
        if leftover or ready:
            raise RuntimeError(f"rank {self.rank}: step ended with unconsumed state {leftover or list(ready)}")
        return RankRecord(tuple(events), tuple(losses[i] for i in sorted(losses)), wait_s)

    def _compute(self, op: Action, ready, units, losses, inputs, targets) -> None:
        s, mb, chunk = op.stage, op.microbatch, op.seq_chunk or 0
        compute = self.compute
        if op.kind is Kind.F:
            unit_index = mb * self.k + chunk
            x = inputs[unit_index] if s == 0 else ready.pop(("F", s - 1, mb, chunk))
            target = targets[unit_index] if s == self.last else None
            if (s, mb, chunk) in self.recomputed:
                out, unit = compute.forward(s, x, target, keep=False)
            elif self.chunks is None:
                out, unit = compute.forward(s, x, target)
            else:
                out, unit = compute.forward(s, x, target, chunk=self.chunks[(s, mb, chunk)])
            units[(s, mb, chunk)] = unit
            if out is not None:
                ready[("F", s, mb, chunk)] = out
            elif unit.loss is not None:
                losses[mb] = losses.get(mb, 0.0) + float(unit.loss)  # chunk losses are weighted to sum
            return
        if op.kind is Kind.W:
            compute.weight_grad(s, units.pop((s, mb, chunk)))
            return
        grad = None if s == self.last else ready.pop(("B", s + 1, mb, chunk))
        unit = units[(s, mb, chunk)]
        if op.kind is Kind.B:
            dx = compute.input_grad(s, unit, grad)
        else:
            dx = compute.full_backward(s, units.pop((s, mb, chunk)), grad)
        if s > 0:
            if dx is None:
                raise ActionError(
                    f"rank {self.rank}, action {op}: stage {s} produced no gradient for its input; "
                    "its output must depend on its input"
                )
            ready[("B", s, mb, chunk)] = dx

    def _check_sent(self, op: Comm, tensor: torch.Tensor, expected: TensorSpec) -> None:
        if tensor.shape == expected.shape and tensor.dtype == expected.dtype:
            return
        got = TensorSpec.of(tensor)
        if got != expected:
            raise SpecMismatchError(
                f"rank {self.rank}: stage {op.stage} produced {got} for microbatch {op.microbatch}, but the shape "
                f"pass of the first step announced {expected} to stage {op.stage + 1}; stage outputs must keep "
                "the shape and dtype of the first step"
            )
