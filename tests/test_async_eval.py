"""`train --async MODE --eval-every N`: the held-out loss after every N-th step and the last,
printed, in `--metrics` and in the report's `eval_losses`, as in a synchronous run, and
equal to what one process computes on the same weights."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeblocks.train.metrics import read_metrics

SRC = str(Path(__file__).resolve().parents[1] / "src")
STEPS = 5
ARGS = ["--async", "pipemare", "--sync-warmup-steps", "1", "-p", "2", "-m", "2", "--layers", "2", "--hidden", "16",
        "--heads", "2", "--seq", "16", "--microbatch-size", "2", "--steps", str(STEPS), "--eval-every", "2",
        "--timeout", "60"]


@pytest.mark.spawn
def test_async_run_evaluates_every_n_steps_and_the_last(tmp_path):
    metrics = tmp_path / "run.jsonl"
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pipeblocks.cli.main", "train", *ARGS, "--metrics", str(metrics),
                           "--report", str(tmp_path / "report.json"), "--checkpoint", str(tmp_path / "ck")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = {int(k): float(v) for k, v in re.findall(rf"^eval +(\d+)/{STEPS} +held-out loss +([\d.]+)", proc.stdout,
                                                       re.M)}
    assert sorted(printed) == [2, 4, 5], proc.stdout
    rows = read_metrics(str(metrics))
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    written = {row["step"]: row["eval_loss"] for row in rows if row["eval_loss"] is not None}
    assert sorted(written) == [2, 4, 5] and all(math.isfinite(v) for v in written.values())
    assert all(abs(written[k] - printed[k]) < 1e-4 for k in written)
    reported = json.loads((tmp_path / "report.json").read_text())["eval_losses"]
    assert [(e["step"], e["loss"]) for e in reported] == sorted(written.items())
    assert abs(_one_process_eval(tmp_path / "ck") - written[STEPS]) < 1e-5 * max(1.0, written[STEPS])


def _one_process_eval(directory: Path) -> float:
    """The held-out loss of the run's last checkpoint (the weights after its last step), all
    stages in this process, one microbatch after the other."""
    import torch

    from pipeblocks.cli.main import build_parser
    from pipeblocks.cli.train import prepare_from_args
    from pipeblocks.models.build import build_model, split_stages
    from pipeblocks.train import checkpoint as ckpt
    from pipeblocks.train.corpus import load_corpus
    from pipeblocks.train.prepare import model_tokenizer

    cfg, _ = prepare_from_args(build_parser().parse_args(["train", *ARGS]))
    spec = cfg.model.spec()
    whole = build_model(spec, seed=cfg.seed, dtype=getattr(torch, cfg.model.weights_dtype))
    stages = split_stages(spec, whole, cfg.schedule.schedule.num_stages, counts=cfg.stage_layers)
    for rank in range(cfg.schedule.p):
        for s, state in ckpt.load_rank(directory, rank=rank, step=STEPS)["stages"].items():
            stages[s].load_state_dict(state)
    corpus = load_corpus(cfg.data, seq=cfg.model.sequence, vocab=cfg.model.vocab,
                         model_tokenizer=model_tokenizer(cfg.model))
    inputs, targets = corpus.split(cfg.held_out)[1].eval_batch(cfg.batch_size)
    total = 0.0
    with torch.no_grad():
        for x, y in zip(inputs.chunk(cfg.schedule.m), targets.chunk(cfg.schedule.m)):
            for stage in stages:
                x = stage(x)
            total += float(spec.loss(x, y))
    return total / cfg.schedule.m

