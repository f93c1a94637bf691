"""PipeMare's defaults are relative to the run: T1's K is a share of the steps the schedule
spans, a config resolves it against that horizon, a resumed run keeps its checkpoint's
settings, and T1 multiplies the scheduled rate (warm-up and decay) as docs/pipemare.md says.
Pure Python (the fast tier), no processes."""
from __future__ import annotations

import pytest

from pipeblocks.core.lowering.async_mode import DEFAULT_LR_WARMUP_FRACTION, AsyncMode, default_k, t1_multiplier
from pipeblocks.schedules import get
from pipeblocks.train.config import ModelChoice, ScheduleSpec, TrainConfig
from pipeblocks.train.loop_options import check_same_kind
from pipeblocks.train.lr_schedule import LRSchedule, resolve_schedule


def test_default_k_is_a_share_of_the_run_that_every_run_reaches():
    assert DEFAULT_LR_WARMUP_FRACTION == 0.25
    assert [default_k(s) for s in (40, 80, 300, 1000)] == [10, 20, 75, 250]
    assert default_k(1) == default_k(3) == 1 and default_k(7) == 1 and default_k(8) == 2  # at least 1, rounded down
    for steps in (1, 2, 5, 40, 80, 301, 10_000):
        assert 1 <= default_k(steps) <= steps  # T1 ends within the run
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="at least one step"):
            default_k(bad)


def test_for_run_fills_only_a_missing_k():
    assert AsyncMode("pipemare").for_run(80).k == 20
    assert AsyncMode("pipemare", lr_warmup_steps=7).for_run(80).k == 7  # given: kept
    assert AsyncMode("pipemare", lr_warmup_steps=0).for_run(80).k == 0  # T1 off stays off
    naive = AsyncMode("naive", sync_warmup_steps=2)
    assert naive.for_run(80) is naive and naive.k == 0
    resolved = AsyncMode("pipemare", sync_warmup_steps=3, discrepancy_decay=0.5).for_run(40)
    assert resolved.describe() == {"mode": "pipemare", "sync_warmup_steps": 3, "K": 10, "D": 0.5}
    with pytest.raises(ValueError, match=r"AsyncMode.for_run\(steps\)"):
        AsyncMode("pipemare").k  # noqa: B018  (the default needs the run's length)


def test_a_config_resolves_k_against_the_steps_its_schedule_spans():
    def cfg(**options) -> TrainConfig:
        return TrainConfig(schedule=ScheduleSpec(get("1f1b")(p=2, m=2)), model=ModelChoice(),
                           async_mode=AsyncMode("pipemare"), **options)

    assert cfg(steps=40).async_mode.k == 10  # no schedule: the run's steps
    fresh = resolve_schedule(None, lr=3e-3, warmup_steps=None, min_lr=None, steps=80)
    assert cfg(steps=80, lr=3e-3, lr_schedule=fresh).async_mode.k == 20
    # a run of 20 steps made to be continued to 80 (--lr-decay-steps 80): the whole run's K
    planned = resolve_schedule(None, lr=3e-3, warmup_steps=None, min_lr=None, steps=20, decay_steps=80)
    assert cfg(steps=20, lr=3e-3, lr_schedule=planned).async_mode.k == 20
    explicit = TrainConfig(schedule=ScheduleSpec(get("1f1b")(p=2, m=2)), model=ModelChoice(), steps=40,
                           async_mode=AsyncMode("pipemare", lr_warmup_steps=100))
    assert explicit.async_mode.k == 100  # an explicit K is the user's, even past the run's end


def test_a_resumed_run_keeps_its_checkpoints_k_and_d():
    saved = AsyncMode("pipemare", sync_warmup_steps=1, lr_warmup_steps=10, discrepancy_decay=0.5).describe()
    resumed = AsyncMode("pipemare", sync_warmup_steps=1).continuing(saved)
    assert (resumed.k, resumed.d) == (10, 0.5)  # not the default of the longer --steps now given
    assert resumed.describe() == saved
    assert AsyncMode("pipemare", lr_warmup_steps=3).continuing(saved).k == 3  # given now: the resume refuses it
    check_same_kind({"p": 2, "async": saved}, "ckpt", p=2, async_mode=resumed)  # the same run: no error
    with pytest.raises(ValueError, match="K=3"):
        check_same_kind({"p": 2, "async": saved}, "ckpt", p=2,
                        async_mode=AsyncMode("pipemare", sync_warmup_steps=1, lr_warmup_steps=3, discrepancy_decay=0.5))
    # a checkpoint of the old fixed default (K = 100) goes on with it
    old = AsyncMode("pipemare", lr_warmup_steps=100).describe()
    assert AsyncMode("pipemare").continuing(old).k == 100
    nesterov = AsyncMode("nesterov", discrepancy_decay=0.3).describe()
    assert AsyncMode("nesterov").continuing(nesterov).d == 0.3
    naive = AsyncMode("naive")
    assert naive.continuing(saved) is naive  # another mode: left for the resume to refuse


def test_t1_divides_the_scheduled_rate_warm_up_included():
    """The documented composition: rate(t) = schedule.rate(t) * t1_multiplier(tau, t, K), the
    run's schedule (warm-up, then cosine) divided by tau^(1 - t/K); so during the warm-up
    the two multiply, and from K on the stage runs at the schedule alone."""
    schedule = resolve_schedule(None, lr=3e-3, warmup_steps=None, min_lr=None, steps=80)
    k = AsyncMode("pipemare").for_run(schedule.total_steps).k
    assert (schedule.warmup_steps, k) == (8, 20)
    rate = [schedule.rate(t) * t1_multiplier(2, t, k) for t in range(80)]
    assert rate[0] == pytest.approx(3e-3 / 9 / 2)  # first warm-up step, divided by the delay
    assert rate[8] == pytest.approx(3e-3 * 2 ** -(1 - 8 / 20))  # the peak, still divided by 2^0.6
    assert rate[20:] == pytest.approx([schedule.rate(t) for t in range(20, 80)])  # T1 over by step K
    # against the schedule alone the product keeps T1's own share of the first K steps'
    # learning, about (1 - 1/tau) / ln(tau) (0.72 at tau = 2), and nearly all of the run's
    kept = sum(rate[:k]) / sum(schedule.rate(t) for t in range(k))
    assert kept == pytest.approx(0.748, abs=1e-3)
    assert sum(rate) / sum(schedule.rate(t) for t in range(80)) == pytest.approx(0.909, abs=1e-3)
    constant = LRSchedule("constant", lr=3e-3)
    assert constant.rate(0) * t1_multiplier(2, 0, k) == pytest.approx(1.5e-3)


@pytest.mark.torch  # the corpus is a tensor
def test_resume_without_k_continues_the_checkpoints_and_a_fresh_run_gets_the_default(monkeypatch):
    from pipeblocks.data import TokenWindows
    from pipeblocks.train import loop_options

    data = TokenWindows.load(None, seq=8)
    saved_mode = AsyncMode("pipemare", lr_warmup_steps=10).describe()
    schedule = resolve_schedule(None, lr=3e-3, warmup_steps=None, min_lr=None, steps=40)
    saved = {"p": 2, "lr": 3e-3, "async": saved_mode, "lr_schedule": schedule.to_json(), "held_out": 0.05}
    monkeypatch.setattr(loop_options, "resumed_meta", lambda directory: saved)
    options = {"steps": 160, "async_mode": AsyncMode("pipemare")}
    resumed, _ = loop_options.resolve_loop_options(options, data, checkpoint="ckpt", resume=True, emulate=None, p=2,
                                                   hidden=64, async_mode=options["async_mode"])
    assert resumed["async_mode"].k == 10  # the checkpoint's, not default_k(160) = 40
    fresh, _ = loop_options.resolve_loop_options(options, data, checkpoint=None, resume=False, emulate=None, p=2,
                                                 hidden=64, async_mode=options["async_mode"])
    cfg = TrainConfig(schedule=ScheduleSpec(get("1f1b")(p=2, m=2)), model=ModelChoice(), **fresh)
    assert cfg.async_mode.k == 40 and cfg.lr_schedule.total_steps == 160
