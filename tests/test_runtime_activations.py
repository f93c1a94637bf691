"""Structured activations on gloo: stages that pass a tuple (a float tensor and int64 token
ids) or a dict (two float tensors and a bool mask) to the next stage, with a side input
(a mask every stage multiplies by) that no rank sends, give the loss and the gradients of
one process chaining the same stages (float64, relative 1e-10), under 1f1b, 1f1b with
recomputation, zb-h1 (split backward) and zb-v (split backward, V placement, 4 stages on
2 ranks). Only the leaves that carry a gradient cross back. A stage whose output changes
shape at a later microbatch stops the run with a clear error, without a hang.

The toy stages live here, at module level, so that spawned ranks import them by name; the
in-process tests (test_runtime_activations_local.py) use them as well.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from pipeblocks import schedules
from pipeblocks.runtime import PipelineRunner, RankFailedError, spawn

pytestmark = pytest.mark.spawn

VOCAB, HIDDEN, SEQ, MICROBATCH = 7, 6, 4, 2
RTOL = 1e-10
CASES = [("tuple", "1f1b"), ("tuple", "1f1b-r"), ("tuple", "zb-h1"), ("tuple", "zb-v"),
         ("dict", "1f1b"), ("dict", "zb-h1"), ("dict", "zb-v")]
M = 4


# ---- the toy stages --------------------------------------------------------------------------
class TupleFirst(nn.Module):
    """ids -> (hidden, ids): a float tensor and the int64 ids it came from."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)

    def forward(self, ids, *, mask):
        return self.embed(ids) * mask[..., None], ids


class TupleMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
        self.embed = nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)

    def forward(self, hidden, ids, *, mask):
        return torch.tanh(self.linear(hidden) + self.embed(ids)) * mask[..., None], ids


class TupleLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)
        self.bias = nn.Embedding(VOCAB, VOCAB, dtype=torch.float64)

    def forward(self, hidden, ids, *, mask):
        return self.head(hidden) * mask[..., None] + self.bias(ids)


class DictFirst(nn.Module):
    """ids -> {"hidden", "gate" (computed from hidden: two floating roots), "keep" (bool)}."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN, dtype=torch.float64)
        self.gate = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)

    def forward(self, ids, *, mask):
        hidden = self.embed(ids) * mask[..., None]
        return {"hidden": hidden, "gate": torch.sigmoid(self.gate(hidden)), "keep": ids % 3 != 0}


class DictMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
        self.gate = nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)

    def forward(self, hidden, gate, keep, *, mask):
        hidden = torch.where(keep[..., None], torch.tanh(self.linear(hidden)) * gate, hidden) * mask[..., None]
        return {"hidden": hidden, "gate": torch.sigmoid(self.gate(hidden)), "keep": keep}


class DictLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)

    def forward(self, hidden, gate, keep, *, mask):
        return self.head(hidden * gate) * mask[..., None] + keep[..., None]


def toy_stages(form: str, num_stages: int, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    first, middle, last = (TupleFirst, TupleMiddle, TupleLast) if form == "tuple" else (DictFirst, DictMiddle, DictLast)
    return [first()] + [middle() for _ in range(num_stages - 2)] + [last()]


def toy_data(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, targets, mask) of a batch of m microbatches."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (m * MICROBATCH, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (m * MICROBATCH, SEQ), generator=gen)
    mask = (torch.rand(m * MICROBATCH, SEQ, generator=gen) > 0.3).to(torch.float64)
    return ids, targets, mask


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def call(stage: nn.Module, x, mask: torch.Tensor):
    if isinstance(x, tuple):
        return stage(*x, mask=mask)
    if isinstance(x, dict):
        return stage(**x, mask=mask)
    return stage(x, mask=mask)


def reference(form: str, num_stages: int, m: int) -> tuple[float, dict[int, list[torch.Tensor]]]:
    """One process chains the stages over the second step's batch."""
    stages = toy_stages(form, num_stages)
    ids, targets, mask = toy_data(m, seed=2)
    x = ids
    for stage in stages:
        x = call(stage, x, mask)
    loss = loss_fn(x, targets)
    loss.backward()
    return loss.item(), {s: [p.grad for p in mod.parameters()] for s, mod in enumerate(stages)}


# ---- the ranks ---------------------------------------------------------------------------------
def record_sends(mailbox) -> list[str]:
    """From now on, the dtype of every tensor this rank sends."""
    sent, send = [], mailbox.send

    def recording(tensor, peer, tag, label):
        sent.append(str(tensor.dtype))
        send(tensor, peer, tag, label)

    mailbox.send = recording
    return sent


def exact_worker(ctx, cases: list[tuple[str, str]], m: int) -> dict:
    """Per case: the second step's loss, gradients and the number of tensors this rank sent."""
    out = {}
    for form, name in cases:
        schedule = schedules.get(name)(p=ctx.world_size, m=m)
        stages = toy_stages(form, schedule.num_stages)
        mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
        runner = PipelineRunner(schedule, mine, loss_fn, timeout_s=30.0)
        ids, targets, mask = toy_data(m, seed=1)
        runner.step(ids, targets, side_inputs={"mask": mask})
        for module in mine.values():
            module.zero_grad(set_to_none=True)
        ids, targets, mask = toy_data(m, seed=2)
        sent = record_sends(runner.mailbox)
        # the side input as a list of m microbatches this time
        result = runner.step(ids, targets, side_inputs={"mask": list(mask.chunk(m))})
        out[(form, name)] = {
            "loss": result.loss,
            "grads": {s: [p.grad.clone() for p in mod.parameters()] for s, mod in mine.items()},
            "sent": sorted(sent),
        }
    return out


class Shrinks(nn.Module):
    """Stage 0 whose output loses a token at its `at`-th real call (microbatch 2 of step 1)."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, ids, *, mask):
        hidden, ids = self.inner(ids, mask=mask)
        if hidden.device.type != "meta":
            self.calls += 1
        return (hidden[:, :-1], ids) if self.calls == self.at else (hidden, ids)


def shrinking_worker(ctx) -> None:
    schedule = schedules.get("1f1b")(p=2, m=M)
    stages = toy_stages("tuple", 2)
    mine = {0: Shrinks(stages[0], at=3)} if ctx.rank == 0 else {1: stages[1]}
    runner = PipelineRunner(schedule, mine, loss_fn, timeout_s=20.0)
    ids, targets, mask = toy_data(M, seed=1)
    runner.step(ids, targets, side_inputs={"mask": mask})


# ---- the tests ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs():
    return spawn(exact_worker, 2, args=(CASES, M), timeout_s=200, threads_per_rank=1)


@pytest.mark.parametrize("form,name", CASES, ids=[f"{f}-{n}" for f, n in CASES])
def test_structured_activations_match_one_process(runs, form, name):
    num_stages = schedules.get(name)(p=2, m=M).num_stages
    ref_loss, ref_grads = reference(form, num_stages, M)
    losses = [r[(form, name)]["loss"] for r in runs if r[(form, name)]["loss"] is not None]
    assert losses == [pytest.approx(ref_loss, rel=RTOL, abs=0)]
    seen = set()
    for rank_result in runs:
        for stage, grads in rank_result[(form, name)]["grads"].items():
            seen.add(stage)
            for got, want in zip(grads, ref_grads[stage], strict=True):
                err = (got - want).abs().max().item() / want.abs().max().item()
                assert err <= RTOL, f"stage {stage}: relative gradient error {err:.3g}"
    assert seen == set(ref_grads)


@pytest.mark.parametrize("form,name", [("tuple", "1f1b"), ("dict", "zb-h1")])
def test_only_activations_and_their_floating_gradients_cross(runs, form, name):
    """Side inputs are not sent; int and bool leaves go forward but send no gradient back."""
    forward = ["torch.float64", "torch.int64"] if form == "tuple" else ["torch.bool", "torch.float64", "torch.float64"]
    backward = ["torch.float64"] if form == "tuple" else ["torch.float64", "torch.float64"]
    assert runs[0][(form, name)]["sent"] == sorted(forward * M)
    assert runs[1][(form, name)]["sent"] == sorted(backward * M)


def test_a_later_microbatch_changing_shape_is_a_clear_error_on_its_rank():
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(shrinking_worker, 2, timeout_s=120, threads_per_rank=1)
    message = str(info.value)
    assert info.value.rank == 0
    assert "SpecMismatchError" in message
    assert ("stage 0, microbatch 2: output[0] is float64[2, 3, 6], but the shape pass of the first step announced "
            "float64[2, 4, 6] to stage 1") in message
    assert "pad" in message
    assert time.monotonic() - start < 60
