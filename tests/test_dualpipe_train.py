"""`pipeblocks train --schedule dualpipe`: each rank builds its two stages as copies of model
stages (equal from the seed), `--verify` is exact in float64 at p = 2 and p = 4 (both copies
of every stage compared), the dry run counts both copies' parameters, and what does not
compose is refused in one line."""
from __future__ import annotations

import re

import pytest

from pipeblocks.train.composition import Draft, check_composition


@pytest.mark.parametrize("options, says", [
    (dict(dp=2), r"--schedule dualpipe with --dp 2 .* use --dp 1 --sharding replicate"),
    (dict(sharding=("zero1",)), r"--schedule dualpipe with --dp 1 --sharding zero1 is not supported"),
    (dict(tp=2), r"--schedule dualpipe with --tp 2 is not supported: drop --tp"),
    (dict(async_mode="pipemare"), r"--schedule dualpipe with --async is not supported"),
    (dict(model_tied=True, model="llama"), r"model llama, whose head is tied to its embedding"),
    (dict(split=True), r"--split with --schedule dualpipe is not supported: .* drop --split"),
    (dict(seq_chunks=2), r"--seq-chunks 2 is not supported: drop --seq-chunks"),
    (dict(clip_grad=1.0), r"--clip-grad with --schedule dualpipe .* both copies"),
    (dict(emulate=True), r"--emulate with --schedule dualpipe is not supported yet"),
    (dict(checkpoint=True), r"--checkpoint with --schedule dualpipe is not supported yet"),
    (dict(checkpoint=True, resume=True), r"--checkpoint with --schedule dualpipe"),
    (dict(save_hf=True), r"--save-hf with --schedule dualpipe is not supported yet"),
])
def test_what_dualpipe_does_not_compose_with_is_one_line(options, says):
    with pytest.raises(ValueError, match=says) as error:
        check_composition(Draft(schedule="dualpipe", **options))
    assert "\n" not in str(error.value)


def test_dualpipe_alone_composes():
    check_composition(Draft(schedule="dualpipe", verify=True, eval_every=2, precision="bf16-mixed"))


@pytest.mark.torch
def test_ranks_build_equal_copies_and_the_dry_run_counts_both():
    """p = 2: rank 0 holds stages 0, 3 (model stages 0, 1), rank 1 stages 1, 2 (model 1, 0);
    each builds its own, and the two copies of a model stage are equal, name by name. The
    dry run's static memory holds the whole model on each rank: dualpipev's two ranks together."""
    import torch

    from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
    from pipeblocks.models import GPTConfig
    from pipeblocks.train.run import dry_run, prepare
    from pipeblocks.train.stage_copies import build_copies

    model = GPTConfig(layers=4, hidden=16, heads=2, seq=16)

    def prepared(name, **costs):
        return prepare(ScheduleRequest(name=name, m=4, mesh=Mesh(pp=2), costs=CostSpec(**costs)), model=model,
                       steps=1, microbatch_size=2)

    cfg, data = prepared("dualpipe")
    assert cfg.stage_layers == (2, 2, 2, 2)
    spec, schedule = cfg.model.spec(), cfg.schedule.schedule
    rank0 = build_copies(spec, schedule, [0, 3], seed=cfg.seed)
    rank1 = build_copies(spec, schedule, [1, 2], seed=cfg.seed)
    for a, b in ((rank0[0], rank1[2]), (rank1[1], rank0[3])):
        assert a.index == b.index and a is not b
        mine, theirs = dict(a.named_parameters()), dict(b.named_parameters())
        assert mine.keys() == theirs.keys() and mine
        assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    static = [r["static_bytes_predicted"] for r in dry_run(cfg, data, out=open("/dev/null", "w"))["ranks"]]
    v_cfg, v_data = prepared("dualpipev", split=(1, 1, 1, 1))
    v_static = [r["static_bytes_predicted"] for r in dry_run(v_cfg, v_data, out=open("/dev/null", "w"))["ranks"]]
    assert static[0] == static[1] == sum(v_static)
    with pytest.raises(ValueError, match="--split with --schedule dualpipe"):
        prepared("dualpipe", split=(1, 1, 1, 1))


@pytest.mark.spawn
def test_train_verify_is_exact_in_float64_at_p2_and_p4_and_trains_with_eval():
    from test_train import _train

    tiny = ("--layers", "4", "--hidden", "16", "--heads", "2", "--seq", "16", "--timeout", "90", "--dtype", "float64")
    losses = {}
    for p, m, b in ((2, 4, 2), (4, 8, 1)):  # the same 8 sequences a step
        proc = _train("--schedule", "dualpipe", "-p", str(p), "-m", str(m), "--microbatch-size", str(b), *tiny,
                      "--verify")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        match = re.search(r"loss ([\d.]+) vs one process .*largest relative difference ([\d.e+-]+), tolerance "
                          r"([\d.e+-]+): OK", proc.stdout, re.S)
        assert match and float(match.group(2)) <= 1e-10, proc.stdout
        losses[p] = float(match.group(1))
    # training: the step's loss is both directions' (as --verify's), evaluation runs the first direction
    proc = _train("--schedule", "dualpipe", "-p", "2", "-m", "4", "--microbatch-size", "2", *tiny, "--steps", "2",
                  "--eval-every", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = re.search(r"step +1/2  loss ([\d.]+)", proc.stdout)
    assert first and float(first.group(1)) == pytest.approx(losses[2], abs=1e-4), proc.stdout
    assert len(re.findall(r"eval +\d/2  held-out loss [\d.]+", proc.stdout)) == 2, proc.stdout
