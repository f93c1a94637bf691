"""Checkpoints, the single-process reference, and `pipeblocks train` end to end."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeblocks.cli.main import main
from pipeblocks.models import GPT, GPTConfig, build_stages, cross_entropy
from pipeblocks.train.checkpoint import check_meta, latest_step, load_rank, restore_rank, save_rank
from pipeblocks.train.reference import compare_grads, reference_step

pytestmark = pytest.mark.spawn

TINY = GPTConfig(layers=2, hidden=16, heads=2, seq=8, vocab=32, dtype="float64")


def _train_steps(stages, opt, steps, start=0):
    losses = []
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, TINY.vocab, (2, TINY.seq), generator=g)
        opt.zero_grad()
        out = x
        for st in stages.values():
            out = st(out)
        loss = cross_entropy(out, torch.roll(x, -1, dims=1)) + 1e-3 * torch.rand(())  # draws from the global RNG
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _fresh():
    stages = {s.index: s for s in build_stages(TINY, seed=0, num_stages=2, stages=(0, 1))}
    return stages, torch.optim.AdamW([p for s in stages.values() for p in s.parameters()], lr=1e-2)


def test_checkpoint_resume_continues_exactly(tmp_path):
    torch.manual_seed(0)
    stages, opt = _fresh()
    straight = _train_steps(stages, opt, 5)

    torch.manual_seed(0)
    stages, opt = _fresh()
    first = _train_steps(stages, opt, 3)
    save_rank(tmp_path, rank=0, step=3, stages=stages, optimizer=opt, meta={"run": "a"})
    _train_steps(stages, opt, 4, start=3)  # diverge after the save: resume must undo this

    stages, opt = _fresh()
    step = latest_step(tmp_path, world_size=1)
    assert step == 3
    assert restore_rank(load_rank(tmp_path, rank=0, step=step), stages, opt) == 3
    assert first + _train_steps(stages, opt, 2, start=3) == straight


def test_latest_step_is_the_newest_every_rank_has_and_old_files_are_pruned(tmp_path):
    stages, opt = _fresh()
    for step in (1, 2, 3):
        save_rank(tmp_path, rank=0, step=step, stages=stages, optimizer=opt, meta={})
    save_rank(tmp_path, rank=1, step=2, stages=stages, optimizer=opt, meta={})
    names = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pt")
    assert names == ["rank0-step00000002.pt", "rank0-step00000003.pt", "rank1-step00000002.pt"]
    assert len(list(tmp_path.glob("*.manifest.json"))) == 3
    assert latest_step(tmp_path, world_size=2) == 2
    assert latest_step(tmp_path, world_size=3) is None
    assert latest_step(tmp_path / "nothing", world_size=1) is None


def test_checkpoint_of_another_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="p: checkpoint 2, now 4.*new --checkpoint directory"):
        check_meta({"p": 2, "schedule": "1f1b"}, {"p": 4, "schedule": "1f1b"}, tmp_path)
    stages, opt = _fresh()
    save_rank(tmp_path, rank=0, step=1, stages={0: stages[0]}, optimizer=opt, meta={})
    with pytest.raises(ValueError, match=r"holds stages \[0\].*gives it \[0, 1\]"):
        restore_rank(load_rank(tmp_path, rank=0, step=1), stages, opt)


def test_reference_step_matches_a_whole_batch_step_and_compare_finds_the_worst():
    x = torch.randint(0, TINY.vocab, (4, TINY.seq), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    loss, grads = reference_step(TINY, seed=0, inputs=x, targets=y, microbatches=2)
    model = GPT(TINY, seed=0)
    whole = cross_entropy(model(x), y)
    whole.backward()
    assert abs(loss - whole.item()) < 1e-12
    expected = {n: p.grad for n, p in model.named_parameters()}
    assert compare_grads(grads, expected).relative < 1e-12
    bumped = dict(grads, **{"head.out.weight": grads["head.out.weight"] * (1 + 1e-6)})
    worst = compare_grads(bumped, expected)
    assert worst.name == "head.out.weight" and 0.5e-6 < worst.relative < 2e-6


# ---- `pipeblocks train` end to end (2 local processes each; every run bounded by timeouts) ----

SRC = str(Path(__file__).resolve().parents[1] / "src")
SMALL = ["-p", "2", "-m", "2", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq", "16",
         "--microbatch-size", "2", "--timeout", "90"]


def _train(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pipeblocks.cli.main", "train", *args], env=env,
                          capture_output=True, text=True, timeout=150)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    proc = _train("--schedule", "1f1b", *SMALL, "--steps", "4", "--report", str(out / "run.json"),
                  "--eval-every", "2", "--metrics", str(out / "m.jsonl"))
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads((out / "run.json").read_text()), out


def test_held_out_loss_and_metrics_file_of_a_run(full_run):
    from pipeblocks.train.metrics import FIELDS, read_metrics

    proc, report, out = full_run
    shown = re.findall(r"^eval +(\d+)/4 +held-out loss +([\d.]+)$", proc.stdout, re.M)
    assert [int(s) for s, _ in shown] == [2, 4]
    assert [(e["step"], round(e["loss"], 4)) for e in report["eval_losses"]] == [(int(s), float(x)) for s, x in shown]
    rows = read_metrics(str(out / "m.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(tuple(r) == FIELDS for r in rows)
    assert [r["loss"] for r in rows] == [x["loss"] for x in report["losses"]]
    assert [r["eval_loss"] for r in rows] == [None, report["eval_losses"][0]["loss"], None,
                                               report["eval_losses"][1]["loss"]]
    # the default schedule: 4 steps are too few for a warm-up; cosine from 3e-3 to 3e-4
    assert rows[0]["lr"] == pytest.approx(3e-3) and rows[-1]["lr"] == pytest.approx(3e-4)
    assert all(r["tokens_per_s"] > 0 and r["static_bytes"] > 0 and r["rank"] == 1 for r in rows)
    assert "(the last 5% held out); lr cosine 0.003 -> 0.0003 over 4 steps" in proc.stdout


def test_train_prints_progress_and_reports_measured_against_simulated(full_run):
    proc, report, out = full_run
    progress = re.findall(r"^step +(\d+)/4 +loss +([\d.]+) +[\d,]+ tokens/s", proc.stdout, re.M)
    assert [int(s) for s, _ in progress] == [1, 2, 3, 4]
    assert float(progress[-1][1]) < float(progress[0][1])  # it learns
    for key in ("schedule", "p", "m", "iteration_time_measured_s", "iteration_time_simulated_s",
                "bubble_ratio_measured", "bubble_ratio_simulated", "ranks"):
        assert key in report, key
    assert (report["schedule"], report["p"], report["m"]) == ("1f1b", 2, 2)
    assert report["iteration_time_measured_s"] > 0 and report["iteration_time_simulated_s"] > 0
    assert 0 <= report["bubble_ratio_measured"] < 1 and 0 <= report["bubble_ratio_simulated"] < 1
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for row in report["ranks"]:
        measured, predicted = row["peak_activation_bytes_measured"], row["peak_activation_bytes_predicted"]
        assert measured > 0 and abs(measured - predicted) <= 0.05 * predicted, row
    assert (out / "run.png").stat().st_size > 0
    assert "peak activation" in proc.stdout
    assert report["t_comm_s"] >= 0 and len(report["stages"]) == 2


@pytest.mark.parametrize("schedule", ["zb-v", "1f1b"])
def test_bf16_mixed_llama_memory_is_predicted_within_5_percent(schedule, tmp_path):
    """bf16-mixed: bfloat16 activations and compute copies, float32 masters, gradients and AdamW
    state; the report's measured activation and static memory per rank are within 5% of the
    prediction, and the activations are those of bfloat16 (about half of fp32's)."""
    reports = {}
    for precision in ("bf16-mixed", "fp32"):
        proc = _train("--schedule", schedule, *SMALL, "--layers", "4", "--steps", "3", "--model-family", "llama",
                      "--kv-heads", "1",
                      "--precision", precision, "--report", str(tmp_path / f"{precision}.json"))
        assert proc.returncode == 0, proc.stderr
        reports[precision] = json.loads((tmp_path / f"{precision}.json").read_text())
    mixed = reports["bf16-mixed"]
    assert mixed["precision"] == "bf16-mixed" and mixed["model"]["family"] == "llama"
    for row, fp32 in zip(mixed["ranks"], reports["fp32"]["ranks"]):
        for kind in ("peak_activation_bytes", "static_bytes"):
            measured, predicted = row[f"{kind}_measured"], row[f"{kind}_predicted"]
            assert measured > 0 and abs(measured - predicted) <= 0.05 * predicted, (kind, row)
        ratio = row["peak_activation_bytes_measured"] / fp32["peak_activation_bytes_measured"]
        # bfloat16 activations; what stays float32 keeps it above one half: the loss on upcast logits (vocab
        # 256 against hidden 16 here: most of the last stage's bytes), the norms' statistics, the token ids
        assert 0.45 < ratio < 0.85, ratio
        # master 4 + copy 2 + gradient 4 + moments 8 against fp32's 4 + 4 + 8
        assert row["static_bytes_measured"] == pytest.approx(fp32["static_bytes_measured"] * 18 / 16, rel=0.01)


def test_resume_from_a_checkpoint_gives_the_same_losses(full_run, tmp_path):
    _, straight, _ = full_run
    # the first run's schedule is made for all 4 steps: the resumed run continues it
    first = _train("--schedule", "1f1b", *SMALL, "--steps", "2", "--lr-decay-steps", "4", "--checkpoint",
                   str(tmp_path / "ck"), "--report", str(tmp_path / "a.json"))
    assert first.returncode == 0, first.stderr
    second = _train("--schedule", "1f1b", *SMALL, "--steps", "4", "--checkpoint", str(tmp_path / "ck"), "--resume",
                    "--report", str(tmp_path / "b.json"))
    assert second.returncode == 0, second.stderr
    assert re.search(r"^step +3/4", second.stdout, re.M) and not re.search(r"^step +1/4", second.stdout, re.M)
    resumed = [json.loads((tmp_path / f).read_text())["losses"] for f in ("a.json", "b.json")]
    assert resumed[0] + resumed[1] == straight["losses"]  # exactly, not approximately


def test_emulated_run_times_the_schedule_without_computing(tmp_path):
    proc = _train("--schedule", "1f1b", *SMALL, "--steps", "3", "--emulate", "5,5,3",
                  "--report", str(tmp_path / "e.json"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["emulated"] is True and report["losses"] == []
    assert all(r["peak_activation_bytes_measured"] is None for r in report["ranks"])
    # one layer per stage: each rank sleeps m * (F + B + W) = 2 * 13 ms per step at least
    assert report["iteration_time_measured_s"] >= 0.026
    assert report["iteration_time_simulated_s"] >= 0.026
    assert "n/a (emulated)" in proc.stdout


@pytest.mark.parametrize("schedule, dtype", [("zb-h1", "float64"), ("v-half", "float32")])
def test_verify_matches_one_process(schedule, dtype):
    proc = _train("--schedule", schedule, *SMALL, "--layers", "4", "--dtype", dtype, "--verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"verify: starting 2 processes for one {schedule} step" in proc.stderr  # not silent while it works
    match = re.search(r"largest relative difference ([\d.e+-]+), tolerance ([\d.e+-]+): OK", proc.stdout)
    assert match and float(match.group(1)) <= float(match.group(2))


@pytest.mark.parametrize("args", [
    ["--schedule", "seq1f1b", "--seq-chunks", "4", "--seq-split", "even"],
    ["--schedule", "zb-h1", "--seq-chunks", "2", "--seq-split", "balanced"],
    ["--schedule", "seq1f1b-i", "-m", "4"],
], ids=["seq1f1b-k4-even", "zb-h1-k2-balanced", "seq1f1b-i-default"])
def test_verify_sequence_chunks_match_whole_sequences(args):
    proc = _train(*SMALL, "--layers", "4", "--dtype", "float64", "--verify", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "seq_chunks=" in proc.stdout
    match = re.search(r"largest relative difference ([\d.e+-]+), tolerance ([\d.e+-]+): OK", proc.stdout)
    assert match and float(match.group(1)) <= 1e-10


def test_sequence_chunk_report_predicts_memory_from_chunk_shares(tmp_path):
    proc = _train("--schedule", "seq1f1b", *SMALL, "--seq", "64", "--seq-chunks", "4", "--steps", "3", "--quiet",
                  "--report", str(tmp_path / "s.json"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "s.json").read_text())
    assert report["seq_chunks"] == 4 and len(report["seq_mem"]) == 4
    shares = report["seq_mem"]
    assert shares[0] > max(shares[1:])  # chunk 0 holds the K/V buffer of the whole sequence
    assert sum(shares) == pytest.approx(1.0, abs=0.05)  # together, what the whole sequence saves
    for row in report["ranks"]:
        measured, predicted = row["peak_activation_bytes_measured"], row["peak_activation_bytes_predicted"]
        assert measured > 0 and abs(measured - predicted) <= 0.10 * predicted, row


@pytest.mark.parametrize(
    "args, message",
    [
        (["--schedule", "nope"], "unknown schedule 'nope'"),
        (["--schedule", "1f1b", "-p", "2", "--layers", "1"], "1 transformer layers but the pipeline has 2 stages"),
        (["--schedule", "v-half", "-p", "2", "--layers", "3"], "3 transformer layers but the pipeline has 4 stages"),
        (["--schedule", "seq1f1b", "-p", "2", "--seq", "8", "--seq-chunks", "9"], "use --seq-chunks 8 or fewer"),
        (["--schedule", "1f1b", "--seq-chunks", "2", "--emulate", "1,1,1"], "does not run sequence chunks"),
        (["--seq", "16", "--data", "TINY"], "has 9 tokens but a sequence of 16 needs at least 17"),
        (["--data", "MISSING"], "does not exist"),
        (["-m", "0"], "argument -m: expected a whole number >= 1"),
        (["--schedule", "v-adaptive", "--memory-limit", "0.1"], "below what any V schedule needs"),
        (["--schedule", "1f1b", "-v", "2"], "does not take -v"),
        (["--resume"], "--resume needs --checkpoint"),
        (["--checkpoint", "EMPTY", "--resume"], "no complete checkpoint"),
        (["--emulate", "1,2"], "three milliseconds"),
        (["--verify", "--emulate", "1,1,1"], "drop --emulate"),
    ],
)
def test_bad_input_is_a_clear_error_before_launch(args, message, tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text("too short")
    paths = {"TINY": str(tmp_path / "tiny.txt"), "MISSING": str(tmp_path / "no.txt"), "EMPTY": str(tmp_path / "e")}
    assert main(["train", *[paths.get(a, a) for a in args]]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err
    assert "training" not in captured.out  # nothing was launched
