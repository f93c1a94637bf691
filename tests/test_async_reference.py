"""The one-process specification of the asynchronous modes (pipedream, naive, pipemare, nesterov):
no delay is synchronous training, pipedream and naive are delayed SGD computed by hand,
T1's rates, T2's estimate, and the errors for bad modes."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from pipeblocks.core import WeightVersions, weight_versions
from pipeblocks.models.toy import ToyConfig, cross_entropy, toy_batch, toy_stages
from pipeblocks.schedules.asynchronous import async_1f1b
from pipeblocks.core.lowering.async_mode import MODES, AsyncMode, lookahead, t1_multiplier, weight_memory
from pipeblocks.train.asynchronous.reference import replay

pytestmark = pytest.mark.torch

CONFIG = ToyConfig(vocab=11, hidden=8, blocks_per_stage=1, seq=5)


def toy_stream(count: int, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = toy_batch(2 * count, CONFIG, seed=seed)
    return list(zip(x.chunk(count), y.chunk(count)))


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def synchronous_training(stages, stream, n):
    """Plain training of the whole model: each step, N microbatches at loss/N, then a step."""
    model = nn.Sequential(*stages)
    optimizer = sgd(list(model.parameters()))
    losses = []
    for step in range(len(stream) // n):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in stream[step * n:(step + 1) * n]:
            loss = cross_entropy(model(x), y)
            (loss / n).backward()
            total += loss.item()
        optimizer.step()
        losses.append(total / n)
    return losses


def assert_same_weights(a, b):
    for stage_a, stage_b in zip(a, b):
        for (name, x), (_, y) in zip(stage_a.named_parameters(), stage_b.named_parameters()):
            assert torch.equal(x, y), name


# (p, N, steps, synchronous warm-up): every delay is 0 in each
ZERO_DELAY = [(3, 4, 1, 0), (1, 2, 3, 0), (3, 2, 1, 3), (4, 3, 1, 2)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p,n,steps,warmup", ZERO_DELAY)
def test_without_delay_every_mode_is_synchronous_training(mode, p, n, steps, warmup):
    versions = weight_versions(async_1f1b(p=p, n=n, steps=steps))
    assert all(versions.max_delay(s) == 0 for s in range(p))
    stream = toy_stream(n * (steps + warmup))
    expected_stages = toy_stages(p, CONFIG, seed=5)
    stages = copy.deepcopy(expected_stages)
    expected = synchronous_training(expected_stages, stream, n)
    result = replay(stages, versions, stream, loss_fn=cross_entropy, optimizer=sgd,
                    mode=AsyncMode(mode, sync_warmup_steps=warmup))
    assert list(result.losses) == expected
    assert_same_weights(stages, expected_stages)


def test_synchronous_warm_up_steps_are_synchronous():
    p, n, warmup = 3, 2, 2
    versions = weight_versions(async_1f1b(p=p, n=n, steps=4))
    stream = toy_stream(n * (warmup + 4))
    expected = synchronous_training(toy_stages(p, CONFIG, seed=5), stream, n)
    for mode in MODES:
        result = replay(toy_stages(p, CONFIG, seed=5), versions, stream, loss_fn=cross_entropy, optimizer=sgd,
                        mode=AsyncMode(mode, sync_warmup_steps=warmup))
        assert len(result.losses) == warmup + 4
        assert list(result.losses[:warmup + 1]) == expected[:warmup + 1]  # the first async step has no delay yet
        assert result.losses[-1] != expected[-1]


class Scale(nn.Module):
    """y = w * x with one scalar weight: delayed SGD on it is easy to write by hand."""

    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w], dtype=torch.float64))

    def forward(self, x):
        return self.w * x


def half_square(out, target):
    return 0.5 * ((out - target) ** 2).sum()


def hand_delayed_sgd(mode: str, weights: list[float], xs, ys, forward_versions, backward_versions, lr):
    """Three scalar stages h1 = a x, h2 = b h1, out = c h2, loss (out - y)^2 / 2, N = 1:
    the forward at the forward versions; the backward of stage s multiplies the incoming
    gradient by the stage's backward weight (pipedream: the forward's, naive: the current)
    and takes d/dw = incoming gradient * the stage's input."""
    history = [[w] for w in weights]
    losses = []
    for m, (x, y) in enumerate(zip(xs, ys)):
        fwd = [history[s][forward_versions[s][m]] for s in range(3)]
        back = fwd if mode == "pipedream" else [history[s][backward_versions[s][m]] for s in range(3)]
        h = [x, fwd[0] * x, fwd[1] * fwd[0] * x]  # each stage's input
        out = back[2] * h[2]  # the last stage recomputes at its backward weight (delay 0: the same)
        losses.append(0.5 * (fwd[2] * h[2] - y) ** 2)
        grad = out - y
        grads = [0.0, 0.0, 0.0]
        for s in (2, 1, 0):
            grads[s] = grad * h[s]
            grad = grad * back[s]
        for s in range(3):
            history[s].append(history[s][-1] - lr * grads[s])
    return [h[-1] for h in history], losses


def _scalar_chain(mode: AsyncMode, steps: int = 7):
    """The three-stage scalar chain the hand computations follow: SGD at lr 0.1, one
    microbatch per step; returns the trained stages, the versions, the data, the start
    weights and the replay's result."""
    versions = weight_versions(async_1f1b(p=3, n=1, steps=steps))
    xs = [1.0 + 0.1 * m for m in range(steps)]
    ys = [0.5 - 0.05 * m for m in range(steps)]
    start = [0.9, 1.2, -0.8]
    stages = [Scale(w) for w in start]
    stream = [(torch.tensor([x], dtype=torch.float64), torch.tensor([y], dtype=torch.float64)) for x, y in zip(xs, ys)]
    result = replay(stages, versions, stream, loss_fn=half_square,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1), mode=mode)
    return stages, versions, xs, ys, start, result


@pytest.mark.parametrize("mode", ["pipedream", "naive"])
def test_delayed_sgd_matches_the_hand_computation(mode):
    stages, versions, xs, ys, start, result = _scalar_chain(AsyncMode(mode))
    assert versions.delays(0)[2:] == (2,) * 5 and versions.delays(1)[1:] == (1,) * 6
    weights, losses = hand_delayed_sgd(mode, start, xs, ys, versions.forward, versions.backward, 0.1)
    assert [s.w.item() for s in stages] == pytest.approx(weights, rel=1e-14)
    assert list(result.losses) == pytest.approx(losses, rel=1e-14)


def test_modes_differ_once_there_is_delay():
    versions = weight_versions(async_1f1b(p=3, n=2, steps=4))
    stream = toy_stream(8)
    final = {}
    for mode in MODES:
        stages = toy_stages(3, CONFIG, seed=5)
        replay(stages, versions, stream, loss_fn=cross_entropy, optimizer=sgd,
               mode=AsyncMode(mode) if mode != "pipemare" else AsyncMode(mode, lr_warmup_steps=2))
        final[mode] = torch.cat([p.detach().flatten() for s in stages for p in s.parameters()])
    assert not torch.equal(final["pipedream"], final["naive"])
    assert not torch.equal(final["naive"], final["pipemare"])


def test_pipemare_with_t1_and_t2_off_is_naive():
    versions = weight_versions(async_1f1b(p=3, n=1, steps=6))
    stream = toy_stream(6)
    naive, off = toy_stages(3, CONFIG, seed=5), toy_stages(3, CONFIG, seed=5)
    a = replay(naive, versions, stream, loss_fn=cross_entropy, optimizer=sgd, mode=AsyncMode("naive"))
    b = replay(off, versions, stream, loss_fn=cross_entropy, optimizer=sgd,
               mode=AsyncMode("pipemare", lr_warmup_steps=0, discrepancy_decay=1.0))
    assert a.losses == b.losses
    assert_same_weights(naive, off)


def test_t1_multiplier_values():
    assert t1_multiplier(4, 0, 10) == 0.25  # the step divided by the delay at first
    assert t1_multiplier(4, 5, 10) == pytest.approx(0.5)  # 4^(-1/2) halfway
    assert t1_multiplier(4, 10, 10) == 1.0 and t1_multiplier(4, 25, 10) == 1.0  # the base rate from K on
    assert t1_multiplier(9, 1, 2) == pytest.approx(1 / 3)
    assert t1_multiplier(1, 0, 10) == 1.0 and t1_multiplier(0, 0, 10) == 1.0  # delay 0 or 1: unchanged
    assert t1_multiplier(8, 0, 0) == 1.0  # K = 0: T1 off
    with pytest.raises(ValueError, match="must be >= 0"):
        t1_multiplier(-1, 0, 1)


def test_t1_sets_each_stage_rate_from_its_step_delay():
    versions = weight_versions(async_1f1b(p=3, n=1, steps=6))
    stages = toy_stages(3, CONFIG, seed=5)
    result = replay(stages, versions, toy_stream(6), loss_fn=cross_entropy,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                    mode=AsyncMode("pipemare", lr_warmup_steps=4, discrepancy_decay=1.0))
    for step, rates in enumerate(result.lrs):
        for s, rate in enumerate(rates):
            assert rate == pytest.approx(0.1 * t1_multiplier(versions.step_delay(s, step), step, 4))
    assert [r[0] for r in result.lrs] == pytest.approx([0.1, 0.1, 0.1 / math.sqrt(2), 0.1 * 2 ** -0.25, 0.1, 0.1])
    assert all(r[1] == 0.1 and r[2] == 0.1 for r in result.lrs)  # delays 1 and 0


class Shift(nn.Module):
    """y = x + w: with a squared loss the whole model is a quadratic in its weights."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w.clone())

    def forward(self, x):
        return x + self.w


def test_t2_estimate_is_closer_to_the_forward_weights_than_the_current_ones():
    p, steps, dim = 4, 40, 6
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(p, dim, generator=gen, dtype=torch.float64)
    target = torch.randn(dim, generator=gen, dtype=torch.float64)
    stream = [(0.1 * torch.randn(dim, generator=gen, dtype=torch.float64), target) for _ in range(steps)]
    versions = weight_versions(async_1f1b(p=p, n=1, steps=steps))
    result = replay([Shift(w) for w in start], versions, stream, loss_fn=half_square,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9),
                    mode=AsyncMode("pipemare", lr_warmup_steps=0), measure_discrepancy=True)
    steady = [d for d in result.discrepancies if d.step >= 10]
    assert {d.delay for d in steady} == {1, 2, 3}
    uncorrected = sum(d.uncorrected for d in steady) / len(steady)
    used = sum(d.used for d in steady) / len(steady)
    assert used < 0.5 * uncorrected
    naive = replay([Shift(w) for w in start], versions, stream, loss_fn=half_square,
                   optimizer=lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9),
                   mode=AsyncMode("naive"), measure_discrepancy=True)
    assert all(d.used == d.uncorrected for d in naive.discrepancies)


def test_weight_memory_per_mode():
    program = async_1f1b(p=4, n=1, steps=8)
    assert weight_memory(program, None) == (1, 1, 1, 1)
    assert weight_memory(program, AsyncMode("naive")) == (1, 1, 1, 1)
    assert weight_memory(program, AsyncMode("pipedream")) == (4, 3, 2, 1)
    assert weight_memory(program, AsyncMode("pipemare")) == (2, 2, 2, 1)  # T2's buffer where there is delay
    assert weight_memory(program, AsyncMode("pipemare", discrepancy_decay=1.0)) == (1, 1, 1, 1)


def test_bad_modes_and_inputs_are_errors():
    with pytest.raises(ValueError, match="unknown asynchronous mode 'gpipe'"):
        AsyncMode("gpipe")
    with pytest.raises(ValueError, match=r"D\) must be a number in \(0, 1\]"):
        AsyncMode("pipemare", discrepancy_decay=0.0)
    with pytest.raises(ValueError, match=r"D\) must be a number in \(0, 1\]"):
        AsyncMode("pipemare", discrepancy_decay=float("nan"))
    with pytest.raises(ValueError, match=r"K\) must be an integer >= 0"):
        AsyncMode("pipemare", lr_warmup_steps=-1)
    with pytest.raises(ValueError, match="mode 'naive' takes no lr_warmup_steps"):
        AsyncMode("naive", lr_warmup_steps=3)
    with pytest.raises(ValueError, match="sync_warmup_steps must be an integer >= 0"):
        AsyncMode("pipedream", sync_warmup_steps=-2)
    versions = WeightVersions.synchronous(2, 2, 2)
    with pytest.raises(ValueError, match="3 microbatches given for 3 steps of 2 .1 of them synchronous.: give 6"):
        replay(toy_stages(2, CONFIG), versions, toy_stream(3), loss_fn=cross_entropy, optimizer=sgd,
               mode=AsyncMode("naive", sync_warmup_steps=1))
    with pytest.raises(ValueError, match="3 stage modules given for versions of 2 stages"):
        replay(toy_stages(3, CONFIG), versions, toy_stream(4), loss_fn=cross_entropy, optimizer=sgd,
               mode=AsyncMode("naive"))


def hand_nesterov(weights: list[float], xs, ys, forward_versions, backward_versions, lr, decay):
    """nesterov on the scalar chain of `hand_delayed_sgd`: each stage keeps the velocity
    EMA d (gamma = D^(1/largest delay)); the forward runs at w_{v_F} + tau * d_{v_F}, the
    backward at the current weights w_{v_B}."""
    history = [[w] for w in weights]
    velocity = [[0.0] for _ in weights]
    top = [max(b - f for f, b in zip(forward_versions[s], backward_versions[s])) for s in range(3)]
    gamma = [decay ** (1 / t) if t else None for t in top]
    losses = []
    for m, (x, y) in enumerate(zip(xs, ys)):
        fwd = []
        for s in range(3):
            v_f, tau = forward_versions[s][m], backward_versions[s][m] - forward_versions[s][m]
            fwd.append(history[s][v_f] + (tau * velocity[s][v_f] if gamma[s] is not None else 0.0))
        back = [history[s][backward_versions[s][m]] for s in range(3)]
        h = [x, fwd[0] * x, fwd[1] * fwd[0] * x]
        losses.append(0.5 * (fwd[2] * h[2] - y) ** 2)
        grad = back[2] * h[2] - y
        grads = [0.0, 0.0, 0.0]
        for s in (2, 1, 0):
            grads[s] = grad * h[s]
            grad = grad * back[s]
        for s in range(3):
            new = history[s][-1] - lr * grads[s]
            if gamma[s] is not None:
                velocity[s].append(gamma[s] * velocity[s][-1] + (1 - gamma[s]) * (new - history[s][-1]))
            history[s].append(new)
    return [h[-1] for h in history], losses


def test_nesterov_matches_the_hand_computation():
    stages, versions, xs, ys, start, result = _scalar_chain(AsyncMode("nesterov", discrepancy_decay=0.3))
    weights, losses = hand_nesterov(start, xs, ys, versions.forward, versions.backward, 0.1, 0.3)
    assert [s.w.item() for s in stages] == pytest.approx(weights, rel=1e-13)
    assert list(result.losses) == pytest.approx(losses, rel=1e-13)
    naive = _scalar_chain(AsyncMode("naive"))[-1]
    assert result.losses[3:] != pytest.approx(naive.losses[3:], rel=1e-6)  # the look-ahead changed the forwards


def test_nesterov_without_its_velocity_is_naive():
    versions = weight_versions(async_1f1b(p=3, n=1, steps=6))
    stream = toy_stream(6)
    naive, off = toy_stages(3, CONFIG, seed=5), toy_stages(3, CONFIG, seed=5)
    a = replay(naive, versions, stream, loss_fn=cross_entropy, optimizer=sgd, mode=AsyncMode("naive"))
    b = replay(off, versions, stream, loss_fn=cross_entropy, optimizer=sgd,
               mode=AsyncMode("nesterov", discrepancy_decay=1.0))
    assert a.losses == b.losses
    assert_same_weights(naive, off)


def test_nesterov_look_ahead_lands_near_the_backward_weights():
    """On the quadratic of the T2 test, the forward's look-ahead point is much closer to the
    weights the backward finds than the forward's own version is."""
    p, steps, dim = 4, 40, 6
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(p, dim, generator=gen, dtype=torch.float64)
    target = torch.randn(dim, generator=gen, dtype=torch.float64)
    stream = [(0.1 * torch.randn(dim, generator=gen, dtype=torch.float64), target) for _ in range(steps)]
    versions = weight_versions(async_1f1b(p=p, n=1, steps=steps))
    stages = [Shift(w) for w in start]
    result = replay(stages, versions, stream, loss_fn=half_square,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9),
                    mode=AsyncMode("nesterov"), measure_discrepancy=True)
    steady = [d for d in result.discrepancies if d.step >= 10]
    assert {d.delay for d in steady} == {1, 2, 3}
    assert all(d.used == d.uncorrected for d in steady)  # the backward runs at the current weights
    naive = replay([Shift(w) for w in start], versions, stream, loss_fn=half_square,
                   optimizer=lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9),
                   mode=AsyncMode("naive"), measure_discrepancy=True)
    naive_steady = [d for d in naive.discrepancies if d.step >= 10]
    assert _mean_used(steady) < 0.5 * _mean_used(naive_steady)


def _mean_used(discrepancies) -> float:
    return sum(d.used for d in discrepancies) / len(discrepancies)


def test_nesterov_memory_and_options():
    program = async_1f1b(p=4, n=1, steps=8)
    assert weight_memory(program, AsyncMode("nesterov")) == (2, 2, 2, 1)
    assert weight_memory(program, AsyncMode("nesterov", discrepancy_decay=1.0)) == (1, 1, 1, 1)
    assert lookahead(AsyncMode("nesterov"), 3) == 3 and lookahead(AsyncMode("naive"), 3) == 0
    with pytest.raises(ValueError, match="mode 'nesterov' takes no lr_warmup_steps"):
        AsyncMode("nesterov", lr_warmup_steps=3)
    with pytest.raises(ValueError, match="mode 'pipedream' takes no discrepancy_decay"):
        AsyncMode("pipedream", discrepancy_decay=0.5)
    with pytest.raises(ValueError, match="delay must be >= 0"):
        lookahead(AsyncMode("nesterov"), -1)
