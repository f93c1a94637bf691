"""The planner's tp = 2 plan runs as printed: at a tiny size, `pipeblocks plan` restricted to
tp = 2 on 4 GPUs prints a `pipeblocks train ... --tp 2` command, which trains (2 steps)."""
from __future__ import annotations

import shlex

import pytest

from pipeblocks.cli.main import main
from pipeblocks.plan import PlanProblem, search
from pipeblocks.plan.report import commands
from pipeblocks.sim.analytic import HARDWARE, TransformerConfig

pytestmark = pytest.mark.spawn


def test_the_printed_command_of_a_tp2_plan_runs(capsys):
    model = TransformerConfig(layers=4, hidden=16, heads=2, seq=8, vocab=256, flash_attention=True, dropout=False)
    problem = PlanProblem(model=model, hardware=HARDWARE["a100-80g"], gpus=4, gpu_memory=80e9, global_batch=8,
                          schedules=("1f1b",), microbatch_sizes=(1,), tp_degrees=(2,), seq_chunks=(1,),
                          precision="fp32")
    result = search(problem, jobs=1)
    best = result.ranked[0].candidate
    assert best.tp == 2 and best.dp * best.tp * best.pp == 4
    train, launch = commands(result)
    assert " --tp 2 " in train and "--model-family gpt" in train and launch.endswith(train.partition("train")[2])
    assert main([*shlex.split(train)[1:], "--steps", "2", "--quiet", "--timeout", "120"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 (4 processes)" in out and "iteration time" in out
