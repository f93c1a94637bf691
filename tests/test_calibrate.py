"""`pipeblocks calibrate` at a tiny grid, its FLOP counter, the B/W partition reused across
microbatches, and memory measured only on the steps asked for."""
from __future__ import annotations

import json

import pytest
import torch

from pipeblocks.cli.main import main
from pipeblocks.sim.hardware_profile import load_profile

pytestmark = pytest.mark.torch


def test_calibrate_writes_a_profile_at_a_tiny_grid_and_skips_what_does_not_fit(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    code = main(["calibrate", "--device", "cpu", "--shapes", "32x16x1x2,64x32x2,300000x64x1", "--no-links",
                 "--repeats", "1", "--threads", "1", "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 0
    skipped = [line for line in captured.err.splitlines() if "300000x64x1" in line]
    assert len(skipped) == 1 and "skipped" in skipped[0] and "GiB" in skipped[0]
    assert "fits best" in captured.out and str(out) in captured.out
    data = json.loads(out.read_text())
    assert data["threads"] == 1 and data["precision"] == "fp32" and "1024 x 1024" in data["peak"]["how"]
    assert data["skipped"][0]["shape"].startswith("300000x64x1")
    blocks = [p for p in data["points"] if p["part"] == "block"]
    assert len(blocks) == 6 and all(p["flops"] > 0 and p["seconds"] > 0 for p in blocks)
    forward = [p for p in blocks if p["pass"] == "F"]
    # the reference GPT saves what the analytic model says (flash attention, no dropout)
    assert all(p["saved_bytes"] == pytest.approx(p["saved_bytes_analytic"], rel=0.02) for p in forward)
    assert not data["links"]["measured"]
    hardware = load_profile(out)
    assert hardware.passes is not None and hardware.flops == data["peak"]["flops"]


def test_cuda_without_cuda_is_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code = main(["calibrate", "--device", "cuda", "-o", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "CUDA is not available" in err


def test_the_counter_counts_the_zero_bubble_flops_of_a_block():
    from pipeblocks.models.family import get_family
    from pipeblocks.runtime.calibrate import count_stage_passes

    from pipeblocks.models import build_model, split_stages

    fam = get_family("gpt")
    s, b, h = 16, 2, 32
    spec = fam.spec(fam.config(layers=3, hidden=h, heads=2, seq=s, vocab=64))
    model = build_model(spec, seed=0)
    tokens = torch.randint(0, 64, (b, s + 1))
    counts = count_stage_passes(split_stages(spec, model, 3), tokens[:, :-1], spec.loss, tokens[:, 1:])
    f, bb, w = counts[1]
    assert f.flops == s * b * h * (24 * h + 4 * s)
    assert bb.flops == s * b * h * (24 * h + 8 * s)
    assert w.flops == 24 * s * b * h * h
    first = counts[0]
    assert first[1].flops == 0 and first[2].flops == bb.flops + w.flops  # stage 0: the whole backward in W
    assert f.intensity > 0


def _grads(stage, x, y, loss_fn, partitions):
    from pipeblocks.runtime.backward import input_backward

    for p in stage.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out = loss_fn(stage(x), y)
    dx, work = input_backward(out, None, x, list(stage.parameters()), partitions=partitions)
    work.run()
    return [dx] + [None if p.grad is None else p.grad.clone() for p in stage.parameters()]


def test_the_partition_is_found_once_and_reused_exactly():
    from pipeblocks.models.family import get_family
    from pipeblocks.runtime.backward import PartitionCache

    from pipeblocks.models import build_model, split_stages

    fam = get_family("gpt")
    spec = fam.spec(fam.config(layers=2, hidden=32, heads=2, seq=16, vocab=64, dtype="float64"))
    stage = split_stages(spec, build_model(spec, seed=0), 2)[1]
    cache = PartitionCache()
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(2, 16, 32, dtype=torch.float64, generator=gen)
        y = torch.randint(0, 64, (2, 16), generator=gen)
        fresh = _grads(stage, x, y, spec.loss, None)
        cached = _grads(stage, x, y, spec.loss, cache)
        assert all(torch.equal(a, c) for a, c in zip(fresh, cached, strict=True))
    assert (cache.hits, cache.misses) == (2, 1)


class _Branchy(torch.nn.Module):
    """A stage whose graph depends on its input: the cache must tell the two apart."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4).double(), torch.nn.Linear(4, 4).double()

    def forward(self, x):
        return self.b(self.a(x)) if x.sum() > 0 else self.b(x) * 2


def test_a_graph_of_another_structure_is_partitioned_afresh():
    from pipeblocks.runtime.backward import PartitionCache

    torch.manual_seed(0)
    stage, cache = _Branchy(), PartitionCache()
    loss = lambda out, _: out.square().sum()  # noqa: E731
    for sign in (1, -1, 1, -1):
        x = sign * torch.rand(3, 4, dtype=torch.float64)
        fresh, cached = _grads(stage, x, None, loss, None), _grads(stage, x, None, loss, cache)
        assert all((a is None and c is None) or torch.equal(a, c) for a, c in zip(fresh, cached, strict=True))
    assert (cache.hits, cache.misses) == (2, 2)


def _toggle_worker(ctx) -> list:
    from pipeblocks import schedules
    from pipeblocks.models import GPTConfig, build_stages, cross_entropy
    from pipeblocks.runtime import PipelineRunner

    schedule = schedules.get("zb-h1")(p=1, m=2)
    cfg = GPTConfig(layers=2, hidden=32, heads=2, seq=16, vocab=64)
    stages = dict(zip((0,), build_stages(cfg, seed=0, num_stages=1, stages=(0,))))
    runner = PipelineRunner(schedule, stages, cross_entropy)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    seen = []
    for on in (True, False, True):
        runner.measure_memory = on
        result = runner.step(tokens[:, :-1], tokens[:, 1:])
        seen.append((result.peak_saved_bytes, len(result.memory_trace), result.loss))
    hits = runner.compute.partitions[0].hits
    return [seen, hits]


@pytest.mark.spawn
def test_memory_is_measured_only_on_the_steps_asked_and_the_partition_is_reused():
    from pipeblocks.runtime import spawn

    (seen, hits), = spawn(_toggle_worker, 1, timeout_s=120, threads_per_rank=1)
    (peak1, trace1, loss1), (peak2, trace2, _), (peak3, trace3, _) = seen
    assert peak1 and peak1 == peak3 and trace1 and trace3
    assert peak2 is None and trace2 == 0
    assert hits >= 5  # 3 steps x 2 microbatches, the first one partitions


@pytest.mark.spawn
def test_links_between_two_local_processes_fit_a_latency_and_a_bandwidth():
    from pipeblocks.runtime.calibrate import measure_links
    from pipeblocks.sim.hardware_profile import link_fields

    raw = measure_links("cpu", sizes=(4, 1 << 16, 1 << 20), rounds=3)
    assert raw["backend"] == "gloo" and len(raw["p2p"]) == 3 and len(raw["all_reduce"]) == 3
    links = link_fields(raw["p2p"], raw["all_reduce"], raw["ranks"])
    assert links["p2p"]["bandwidth_bytes_per_s"] > 0 and links["p2p"]["latency_s"] >= 0
    assert links["all_reduce"]["bandwidth_bytes_per_s"] > 0
