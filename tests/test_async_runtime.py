"""`train --async MODE`: the runtime executes the asynchronous Program exactly as the
one-process replay defines each mode, measures the Program's delays, and without delay
is ordinary training. One spawn (p=3) runs every case."""
from __future__ import annotations

import pytest
import torch

from pipeblocks.data import TokenWindows
from pipeblocks.models import GPT, GPTConfig, cross_entropy
from pipeblocks.runtime import spawn
from pipeblocks.schedules import get
from pipeblocks.schedules.asynchronous import one_f_one_b_delay
from pipeblocks.core.lowering.async_mode import AsyncMode
from pipeblocks.train.asynchronous.run import check_against_replay
from pipeblocks.core.cost.precision import precision_policy
from pipeblocks.train.config import EmulationSpec, MeshSpec, ModelChoice, ScheduleSpec, TrainConfig

from _async_cases import async_worker

pytestmark = pytest.mark.spawn

P, N, STEPS = 3, 2, 4
MODEL = GPTConfig(layers=3, hidden=16, heads=2, seq=8, vocab=256, dtype="float64")
CASES = {
    "pipedream": AsyncMode("pipedream"),
    "naive": AsyncMode("naive"),
    "pipemare": AsyncMode("pipemare", lr_warmup_steps=3, discrepancy_decay=0.1, sync_warmup_steps=1),
    "nesterov": AsyncMode("nesterov", discrepancy_decay=0.1),
    "synchronous": AsyncMode("naive", sync_warmup_steps=STEPS - 1),  # the one asynchronous step has no delay
}


def _cfg(mode: AsyncMode, p: int = P, **extra) -> TrainConfig:
    options = {"verify": True, **extra}
    return TrainConfig(schedule=ScheduleSpec(get("1f1b")(p=p, m=N)), model=ModelChoice("gpt", MODEL),
                       precision=precision_policy(MODEL.dtype), mesh=MeshSpec(threads_per_rank=1), steps=STEPS,
                       microbatch_size=2, lr=1e-2, async_mode=mode, timeout_s=60.0, **options)


CONFIGS = {name: _cfg(mode) for name, mode in CASES.items()}
CONFIGS["emulated"] = _cfg(AsyncMode("naive"), emulation=EmulationSpec((1.0, 1.0, 0.0)), verify=False)


@pytest.fixture(scope="module")
def runs():
    out = spawn(async_worker, P, args=(list(CONFIGS.values()),), timeout_s=120, threads_per_rank=1)
    return {name: [rank[i] for rank in out] for i, name in enumerate(CONFIGS)}


@pytest.fixture(scope="module")
def single_stage():
    """pipemare with T1 and T2 on one stage: no delay, so neither changes anything."""
    cfg = _cfg(AsyncMode("pipemare", lr_warmup_steps=3, discrepancy_decay=0.1), p=1)
    return cfg, spawn(async_worker, 1, args=([cfg],), timeout_s=120, threads_per_rank=1)[0][0]


@pytest.fixture(scope="module")
def data():
    return TokenWindows.load(None, seq=MODEL.seq)


@pytest.mark.parametrize("name", ["pipedream", "naive", "pipemare", "nesterov", "synchronous"])
def test_runtime_equals_the_replay(runs, data, name):
    check = check_against_replay(CONFIGS[name], data, runs[name])
    assert check.delays_equal
    assert check.largest <= 1e-10, check
    assert check.ok


def test_measured_delays_are_the_programs(runs):
    w = CASES["pipemare"].sync_warmup_steps
    for r in runs["pipemare"]:
        for s in r.stages:
            delays = r.delays[s]
            assert delays[:w * N] == (0,) * (w * N)  # the synchronous warm-up
            expected = tuple(one_f_one_b_delay(p=P, n=N, stage=s, microbatch=m) for m in range(N * (STEPS - w)))
            assert delays[w * N:] == expected
    assert max(d for r in runs["naive"] for s in r.stages for d in r.delays[s]) == 1  # stage 0 crosses a step


def test_pipedream_stashes_what_the_program_says_and_the_others_nothing(runs):
    from pipeblocks.core.lowering.versions import stashed_versions
    from pipeblocks.schedules.asynchronous import async_1f1b

    stashes = stashed_versions(async_1f1b(p=P, n=N, steps=STEPS))
    assert stashes == (2, 2, 1)
    for name in ("pipedream", "naive", "pipemare", "nesterov"):
        held = {s: v for r in runs[name] for s, v in r.versions_held.items()}
        assert held == ({s: stashes[s] for s in range(P)} if name == "pipedream" else dict.fromkeys(range(P), 1))


def test_the_check_fails_for_another_mode(runs, data):
    # the runtime's naive run is not pipedream: the modes differ and the comparison sees it
    check = check_against_replay(CONFIGS["pipedream"], data, runs["naive"])
    assert not check.ok and check.weights > 1e-6


def _ordinary_training(data):
    """Synchronous training in one process: the whole model, m microbatches per step."""
    model = GPT(MODEL, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for k in range(STEPS):
        x, y = data.batch(k, N * 2, seed=0)
        total = 0.0
        for xm, ym in zip(x.chunk(N), y.chunk(N)):
            loss = cross_entropy(model(xm), ym)
            (loss / N).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / N)
    return losses, {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["all steps synchronous", "one stage"])
def test_without_delay_it_is_ordinary_training(runs, single_stage, data, case):
    results = runs["synchronous"] if case == "all steps synchronous" else [single_stage[1]]
    losses, weights = _ordinary_training(data)
    assert next(r.losses for r in results if r.losses) == pytest.approx(losses, rel=1e-10)
    for r in results:
        assert set(r.delays) and all(d == 0 for delays in r.delays.values() for d in delays)
        for (_, name), tensor in r.params.items():
            assert torch.allclose(tensor, weights[name], rtol=1e-10, atol=1e-12), name


def test_emulated_async_run_times_the_program(runs):
    # 1 ms per pass and layer, 8 microbatches through 3 stages: at least 8 forwards and backwards on a rank
    assert all(r.async_s >= 16e-3 and r.losses == () for r in runs["emulated"])
