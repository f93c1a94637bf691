"""Runs one rank's lowered Program for one step.

The executor walks `program.ranks[rank]` in order and knows nothing about schedules:

    Action F    take the input (step input on stage 0, a received or locally handed-over
                activation otherwise), run the forward (with the microbatch's side
                inputs, if any), check the output against the shape pass's spec, hand
                it on
    Action B    take the output gradient (received, handed over, or the loss), compute the
                input gradient, hand it on; what W needs stays in the unit
    Action W    weight gradients of that unit
    Action BW   fused backward
    Comm RECV   wait for the receive (posted earlier by the plan in comm.py)
    Comm SEND   queue an isend of the tensor the previous action produced
    DPOp        UNSHARD / RESHARD / REDUCE_GRAD, handed to the rank's `DataParallel`
                (data_parallel.py), which launches them without waiting; every compute
                action first lets it wait for what the action's stage needs (and
                names itself, so that a stage's last weight-gradient pass can launch
                its units' reductions inside it)
    Recompute   re-run the forward of a unit whose F ran without its graph (the F of
                every unit the Program recomputes does), just before its backward
    Overlap     a forward and another unit's fused backward as one op (both received
                before it): through the compute object's `overlap_hook` when the stage
                modules' class has `overlapped_forward_backward` (DualPipe's
                interface), else the forward then the backward; two events
    VocabPass   IF, S, T or IB of a microbatch (vocabulary parallelism, `core.ir.vocab`): run
                by the `vocab` object (`vocab_step.VocabStep`); stage 0 then takes the
                embedding output from it and hands it its input gradient, and the last
                stage hands it its output X and takes dL/dX from it (no loss on a stage);
                an event of the timeline (as in the simulator's) from when its input (X,
                C0's statistics, the embedding gradient) was in: the wait is idle
    STEP        an optimizer step inside the Program (asynchronous training): handed to
                the compute object's `optimizer_step(stage, step)`; only a compute object
                that has that method runs a Program with steps

An activation may be a tuple or dict of tensors (shapes.py): each of its leaves is a
receive and a send of its own (one tag per leaf), and a gradient has one leaf per
floating leaf of its activation (none: nothing crosses).

With sequence chunks (schedule.seq_chunks = k > 1) the step's inputs and targets come cut
into m*k units (index microbatch*k + chunk) and each forward gets the unit's
`SequenceChunk` from `chunks` (sequence.py).

A compute object with a `microbatch_limit()` (asynchronous training) can drain a Program
early: once it names a limit, the ops of that microbatch and later ones are skipped, their
receives never posted (train/asynchronous/drain.py says when that is safe).

Two stages of one rank that are neighbours (the turn of a V) hand over through a dict:
the Program has no comm op for them. Unknown op types raise, naming the op.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..core.ir.actions import Action, Kind
from ..core.ir.ops import ACTION, Comm, DP, DPOp, OVERLAP, OptimizerStep, Overlap, P2P, RECOMPUTE, Recompute, STEP, VOCAB, require_known
from ..core.ir.program import Program
from ..core.lowering.recompute import recompute_units
from ..core.ir.vocab import VocabPass
from .comm import Mailbox, Tags, leaf_key, receive_posts
from .compute import Unit
from .sequence import SequenceChunk
from .shapes import TENSOR, ActivationSpec, SpecMismatchError, TensorSpec, activation_spec, leaves_of

__all__ = ["RankExecutor", "RankRecord", "ActionError"]

_COMPUTE, _SEND, _RECV, _DP, _RECOMPUTE, _STEP, _PAIR, _VOCAB = (  # plan op codes
    "compute", "send", "recv", "dp", "recompute", "step", "pair", "vocab")


def _microbatch_of(code: str, op, key) -> int:
    """The microbatch an op of the plan works on (-1 for DP ops and optimizer steps)."""
    if code is _SEND or code is _RECV:
        return key[2]
    if code is _COMPUTE or code is _RECOMPUTE:
        return op.microbatch
    if code is _PAIR:
        return min(op.forward.microbatch, op.backward.microbatch)
    if code is _VOCAB:
        return op.microbatch
    return -1


class ActionError(RuntimeError):
    """A compute action raised; the message names the rank, the action and the input spec."""


@dataclass(frozen=True)
class RankRecord:
    """What one rank measured in one step (times from `clock`, in seconds)."""

    events: tuple[tuple[Action | Recompute | VocabPass, float, float], ...]
    losses: tuple[float, ...]
    wait_s: float


class RankExecutor:
    """Executes `program.ranks[rank]`; `specs` maps every received key to the spec of its
    activation (for a "B" key, the activation whose gradient it is; a TensorSpec is one
    tensor's) and `out_specs[(stage, mb, chunk)]` is what this rank's stages must produce;
    `chunks` maps (stage, mb, chunk) to its SequenceChunk when the schedule has sequence
    chunks."""

    def __init__(
        self,
        program: Program,
        rank: int,
        compute,
        mailbox: Mailbox,
        device: torch.device,
        specs: dict[tuple, ActivationSpec | TensorSpec],
        out_specs: dict[tuple[int, int, int], ActivationSpec | TensorSpec],
        clock: Callable[[], float] = time.perf_counter,
        chunks: dict[tuple[int, int, int], SequenceChunk] | None = None,
        data_parallel=None,
        vocab=None,
    ) -> None:
        schedule = program.schedule
        self.ops = program.ranks[rank]
        self.rank = rank
        self.last = schedule.num_stages - 1
        # a schedule of several chains (DualPipe) takes inputs and computes losses at each
        # chain's ends: stage numbers that start a chain, and its loss stages
        self.starts = frozenset(s for s in range(schedule.num_stages) if schedule.starts_chain(s))
        self.ends = frozenset(s for s in range(schedule.num_stages) if schedule.ends_chain(s))
        self.m = schedule.m
        self.compute = compute
        self.mailbox = mailbox
        self.device = device
        self.specs = {key: activation_spec(spec) for key, spec in specs.items()}
        self.out_specs = {key: activation_spec(spec) for key, spec in out_specs.items()}
        self.clock = clock
        self.chunks = chunks
        self.k = schedule.seq_chunks
        self.tags = Tags(schedule.num_stages, schedule.m, schedule.seq_chunks)
        self.posts = receive_posts(program, rank)
        self.dp = data_parallel
        self.vocab = vocab
        if vocab is not None:  # stage 0 and the last stage end at the vocabulary passes
            self.starts = self.ends = frozenset()
        self.recomputed = recompute_units(self.ops)
        if self.recomputed and schedule.seq_chunks > 1:
            raise ValueError(
                f"rank {rank}: the runtime does not recompute sequence chunks (schedule {schedule.name!r} has "
                f"{schedule.seq_chunks}): a chunk's recomputation would append its K/V twice; drop the "
                "recomputation or the sequence chunks"
            )
        known = (ACTION, P2P, RECOMPUTE, OVERLAP) + ((DP,) if data_parallel else ())
        known += (STEP,) if hasattr(compute, "optimizer_step") else ()
        known += (VOCAB,) if vocab is not None else ()
        require_known(self.ops, f"the runtime (rank {rank})", known)
        self._plan = self._compile()
        # an asynchronous Program may be drained early: its compute object names the first
        # microbatch not to run (train/asynchronous/drain.py); None: run every op
        self._limit_of = getattr(compute, "microbatch_limit", None)

    def _compile(self) -> list[tuple]:
        """Per op, everything the step loop needs that does not change between steps: the
        receives to post (leaf key, spec, peer, tag), the op's key, peer, tag (for a receive:
        the index of the pass after it) and labels. At a few milliseconds per pass every
        microsecond between two passes is bubble, so the loop looks nothing up and formats
        no text."""
        plan = []
        next_compute = len(self.ops) - 1
        for index in reversed(range(len(self.ops))):
            op = self.ops[index]
            posts = tuple(post for r in self.posts.get(index, ()) for post in self._leaf_posts(r))
            if isinstance(op, Action):
                next_compute = index
                plan.append((posts, _COMPUTE, op, None, 0, 0, None))
            elif type(op) is Overlap:
                next_compute = index
                plan.append((posts, _PAIR, op, None, 0, 0, None))
            elif type(op) is DPOp:
                plan.append((posts, _DP, op, None, 0, 0, None))
            elif type(op) is Recompute:
                plan.append((posts, _RECOMPUTE, op, op.unit, 0, 0, None))
            elif type(op) is OptimizerStep:
                plan.append((posts, _STEP, op, None, 0, 0, None))
            elif type(op) is VocabPass:
                plan.append((posts, _VOCAB, op, None, 0, 0, None))
            elif op.send:
                count = len(self._sent_spec(op.key).leaves)
                leaves = tuple((self.tags.data(op.key, i), str(op) if count == 1 else f"{op} (leaf {i})")
                               for i in range(count))
                plan.append((posts, _SEND, op, op.key, op.peer, 0, leaves))
            else:
                spec = self._received_spec(op.key)
                keys = tuple(leaf_key(op.key, i) for i in range(len(spec.leaves)))
                plan.append((posts, _RECV, op, op.key, op.peer, next_compute,
                             (f"{op} from rank {op.peer}", spec.layout, keys)))
        plan.reverse()
        return plan

    def _received_spec(self, key: tuple) -> ActivationSpec:
        spec = self.specs[key]
        return spec.gradient() if key[0] == "B" else spec

    def _sent_spec(self, key: tuple) -> ActivationSpec:
        payload, stage, mb, chunk = key
        if payload == "F":
            return self.out_specs[(stage, mb, chunk)]
        received = ("F", stage - 1, mb, chunk)  # the input whose gradient this is
        spec = self.specs[received] if received in self.specs else self.out_specs[(stage - 1, mb, chunk)]
        return spec.gradient()

    def _leaf_posts(self, recv: Comm) -> list[tuple]:
        spec = self._received_spec(recv.key)
        return [(leaf_key(recv.key, i), leaf, recv.peer, self.tags.data(recv.key, i))
                for i, leaf in enumerate(spec.leaves)]

    def run(self, inputs: list | None, targets: list | None, side: list[dict] | None = None) -> RankRecord:
        """One step. inputs and targets: per unit (microbatch * k + chunk) on the ranks of
        the first and last stage; side: per microbatch, the side inputs every forward gets."""
        ready: dict[tuple, object] = {}  # activations/gradients handed to a local consumer or a SEND
        units: dict[tuple, Unit] = {}
        losses: dict[int, float] = {}
        events: list[tuple[Action, float, float]] = []
        wait_s = 0.0
        mailbox, clock, plan = self.mailbox, self.clock, self._plan
        posted = -1  # the receives of every op up to this index are posted
        limit_of, limit = self._limit_of, None
        for index, (posts, code, op, key, peer, tag, extra) in enumerate(plan):
            if limit_of is not None:
                limit = limit_of()
            if index > posted:
                self._post(posts, limit)
                posted = index
            if limit is not None and _microbatch_of(code, op, key) >= limit:
                continue  # drained: this microbatch never entered the pipeline
            if code is _SEND:
                self._send(op, ready.pop(key), peer, extra)
                continue
            if code is _RECV:
                label, layout, keys = extra
                if not all(map(mailbox.arrived, keys)):
                    # Idle until the transfer lands: post the receives due before the next pass
                    # now, so that their cost is not paid between the hand-over and that pass.
                    for ahead in range(posted + 1, tag + 1):
                        self._post(plan[ahead][0], limit)
                    posted = max(posted, tag)
                start = clock()
                if layout is TENSOR:
                    ready[key] = mailbox.wait(key, label)
                else:
                    ready[key] = layout.build([mailbox.wait(k, label) for k in keys])
                wait_s += clock() - start
                continue
            if code is _DP:
                mailbox.flush()  # a collective may block: the pipeline peers get their tensors first
                self.dp.run(op)
                continue
            if code is _VOCAB:
                mailbox.flush()  # S and IB may wait for a peer: the pipeline peers get their tensors first
                start = clock()
                waited = self.vocab.run(op) or 0.0
                wait_s += waited
                events.append((op, start + waited, clock()))  # from when its input was in, as simulated
                continue
            if code is _STEP:
                mailbox.flush()  # the peers get this rank's tensors before the step's compute
                self.compute.optimizer_step(op.stage, op.step)
                continue
            mailbox.flush()
            if code is _PAIR:
                self._pair(op, ready, units, losses, inputs, targets, side, events)
                continue
            self._timed_compute(code, op, key, ready, units, losses, inputs, targets, side, events)
        start = clock()
        mailbox.finish()
        wait_s += clock() - start
        leftover = [k for k, u in units.items() if u.root is not None or u.work is not None or u.kept is not None]
        if leftover or ready:
            raise RuntimeError(f"rank {self.rank}: step ended with unconsumed state {leftover or list(ready)}")
        return RankRecord(tuple(events), tuple(losses[i] for i in sorted(losses)), wait_s)

    def _post(self, posts, limit: int | None) -> None:
        """Post the receives `posts` of one op (those of microbatches below `limit`)."""
        for recv_key, spec, recv_peer, recv_tag in posts:
            if limit is None or recv_key[2] < limit:
                self.mailbox.recv(recv_key, spec.empty(self.device), recv_peer, recv_tag)

    def _send(self, op, value, peer: int, leaf_tags) -> None:
        """Send each floating leaf of `value` to `peer`, as the shape pass planned them."""
        leaves = [value] if isinstance(value, torch.Tensor) else leaves_of(value)
        if len(leaves) != len(leaf_tags):
            raise ActionError(
                f"rank {self.rank}: {op} has {len(leaves)} tensors to send, but the shape pass planned "
                f"{len(leaf_tags)}: a backward must return one gradient per floating leaf of its input"
            )
        for tensor, (leaf_tag, label) in zip(leaves, leaf_tags):
            self.mailbox.send(tensor if tensor.is_contiguous() else tensor.contiguous(), peer, leaf_tag, label)

    def _timed_compute(self, code, op, key, ready, units, losses, inputs, targets, side, events) -> None:
        """Run one compute action or recomputation between the DP hooks, its event recorded;
        an error names the rank and the action."""
        if self.dp is not None:
            self.dp.before_compute(op.stage, op)
        start = self.clock()
        try:
            if code is _RECOMPUTE:
                self.compute.recompute(op.stage, units[key])
            else:
                self._compute(op, ready, units, losses, inputs, targets, side)
        except (SpecMismatchError, ActionError):
            raise
        except Exception as err:
            raise ActionError(f"rank {self.rank}, action {op}: {type(err).__name__}: {err}") from err
        events.append((op, start, self.clock()))
        if self.dp is not None:
            self.dp.after_compute()

    def _pair(self, op: Overlap, ready, units, losses, inputs, targets, side, events) -> None:
        """An overlapped pair: the stage modules' hook runs both parts at once where it exists
        (the parts' events then share its time evenly), else the forward then the backward."""
        f, bw = op
        if self.dp is not None:
            self.dp.before_compute(f.stage, f)
            self.dp.before_compute(bw.stage, bw)
        hook = getattr(self.compute, "overlap_hook", None)
        clock = self.clock
        start = clock()
        try:
            if hook is not None and hook(f.stage, bw.stage) and self.chunks is None:
                self._hooked_pair(f, bw, ready, units, losses, inputs, targets, side)
                end = clock()
                mid = start + (end - start) / 2
            else:
                self._compute(f, ready, units, losses, inputs, targets, side)
                mid = clock()
                self._compute(bw, ready, units, losses, inputs, targets, side)
                end = clock()
        except (SpecMismatchError, ActionError):
            raise
        except Exception as err:
            raise ActionError(f"rank {self.rank}, action {op}: {type(err).__name__}: {err}") from err
        events.append((f, start, mid))
        events.append((bw, mid, end))
        if self.dp is not None:
            self.dp.after_compute()

    def _hooked_pair(self, f: Action, bw: Action, ready, units, losses, inputs, targets, side) -> None:
        s, mb = f.stage, f.microbatch
        x = inputs[mb] if s in self.starts else ready.pop(("F", s - 1, mb, 0))
        target = targets[mb] if s in self.ends else None
        grad = None if bw.stage in self.ends else ready.pop(("B", bw.stage + 1, bw.microbatch, 0))
        out, unit, dx = self.compute.overlapped(
            s, x, target, bw.stage, units.pop((bw.stage, bw.microbatch, 0)), grad,
            side=side[mb] if side else None, keep=(s, mb, 0) not in self.recomputed,
        )
        units[(s, mb, 0)] = unit
        if out is not None:
            expected = self.out_specs.get((s, mb, 0))
            if expected is not None:
                self._check_output(f, out, expected)
            ready[("F", s, mb, 0)] = out
        elif unit.loss is not None:
            losses[mb] = losses.get(mb, 0.0) + float(unit.loss)
        if bw.stage not in self.starts:
            if dx is None:
                raise ActionError(f"rank {self.rank}, action {bw}: stage {bw.stage} produced no gradient for its input")
            ready[("B", bw.stage, bw.microbatch, 0)] = dx

    def _compute(self, op: Action, ready, units, losses, inputs, targets, side) -> None:
        s, mb, chunk = op.stage, op.microbatch, op.seq_chunk or 0
        compute = self.compute
        if op.kind is Kind.F:
            unit_index = mb * self.k + chunk
            if self.vocab is not None and s == 0:
                x = self.vocab.embedding_output(mb)
            else:
                x = inputs[unit_index] if s in self.starts else ready.pop(("F", s - 1, mb, chunk))
            target = targets[unit_index] if s in self.ends else None
            extra = {"side": side[mb]} if side else {}  # only then: compute objects without side inputs work
            if (s, mb, chunk) in self.recomputed:
                out, unit = compute.forward(s, x, target, keep=False, **extra)
            elif self.chunks is None:
                out, unit = compute.forward(s, x, target, **extra)
            else:
                out, unit = compute.forward(s, x, target, chunk=self.chunks[(s, mb, chunk)], **extra)
            units[(s, mb, chunk)] = unit
            if self.vocab is not None and s == self.last:
                self.vocab.after_last_forward(mb, out)  # X: to the S passes of every rank
            elif out is not None:
                expected = self.out_specs.get((s, mb, chunk))
                if expected is not None:
                    self._check_output(op, out, expected)
                ready[("F", s, mb, chunk)] = out
            elif unit.loss is not None:
                losses[mb] = losses.get(mb, 0.0) + float(unit.loss)  # chunk losses are weighted to sum
            return
        if op.kind is Kind.W:
            compute.weight_grad(s, units.pop((s, mb, chunk)))
            return
        if self.vocab is not None and s == self.last:
            grad = self.vocab.last_output_grad(mb)  # dL/dX from C0
        else:
            grad = None if s in self.ends else ready.pop(("B", s + 1, mb, chunk))
        unit = units[(s, mb, chunk)]
        if op.kind is Kind.B:
            dx = compute.input_grad(s, unit, grad)
        else:
            dx = compute.full_backward(s, units.pop((s, mb, chunk)), grad)
        if self.vocab is not None and s == 0:
            self.vocab.after_first_backward(mb, dx)  # to the IB passes of every rank
        elif s not in self.starts:
            if dx is None:
                raise ActionError(
                    f"rank {self.rank}, action {op}: stage {s} produced no gradient for its input; "
                    "its output must depend on its input"
                )
            ready[("B", s, mb, chunk)] = dx

    def _check_output(self, op: Action, out: object, expected: ActivationSpec) -> None:
        """Before the output goes anywhere: the spec the shape pass announced to the next stage
        (whose receive buffers have it), or a SpecMismatchError on this rank."""
        if isinstance(out, torch.Tensor) and expected.layout.kind == "tensor":
            leaf = expected.leaves[0]
            if out.shape == leaf.shape and out.dtype == leaf.dtype:
                return
        problem = expected.mismatch(out)
        if problem is None:
            return
        path, got, want = problem
        chunk = f", sequence chunk {op.seq_chunk}" if op.seq_chunk is not None else ""
        whole = f" (the whole output: {expected})" if path != "output" else ""
        raise SpecMismatchError(
            f"rank {self.rank}: stage {op.stage}, microbatch {op.microbatch}{chunk}: {path} is {got}, but the shape "
            f"pass of the first step announced {want} to stage {op.stage + 1}{whole}; stage outputs must keep their "
            "shapes and dtypes across microbatches and steps: pad them to one shape (passing a mask as a side "
            "input or an output), or build a new PipelineRunner for new shapes"
        )
