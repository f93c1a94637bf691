"""The vocabulary passes in emulated compute (`runtime.vocab_emulate`): a Program lowered with
IF, S, T and IB runs on gloo with every pass sleeping its modelled time, the passes'
transfers and collectives real on toy tables; the measured step follows the simulated one."""
from __future__ import annotations

import pytest

from pipeblocks.core.cost.costs import Costs
from pipeblocks.core.ir.vocab import VocabCosts, VocabPass
from pipeblocks.runtime.vocab_emulate import VocabPassTimes

# ms: the vocabulary passes outweigh a stage's, so a run that skipped their sleeps would be
# far shorter than simulated
STAGE_MS = (2.0, 2.0, 2.0)
VOCAB = VocabCosts(t_s=6.0, t_t=4.0, t_if=1.0, t_ib=1.0)


def test_pass_times_scale_the_costs_and_refuse_negative():
    times = VocabPassTimes.from_costs(VOCAB, ms_per_unit=0.5)
    assert [times.ms(k) for k in ("IF", "S", "T", "IB")] == [0.5, 3.0, 2.0, 0.5]
    with pytest.raises(ValueError, match="ms_per_unit must be > 0"):
        VocabPassTimes.from_costs(VOCAB, ms_per_unit=0.0)
    with pytest.raises(ValueError, match="s_ms must be >= 0 ms"):
        VocabPassTimes(0.0, -1.0, 0.0, 0.0)


def _worker(ctx, m, steps):
    import torch

    from pipeblocks import schedules
    from pipeblocks.models.toy import ToyConfig, cross_entropy, toy_batch, toy_stages
    from pipeblocks.runtime import PipelineRunner
    from pipeblocks.runtime.emulate import EmulatedCompute, EmulatedCosts
    from pipeblocks.runtime.vocab_emulate import toy_vocab_step
    from pipeblocks.runtime.vocab_link import DistVocabLink

    schedule = schedules.get("1f1b")(p=2, m=m)
    S = schedule.num_stages
    config = ToyConfig(vocab=16, hidden=8, seq=4)
    stages = toy_stages(S, config, dtype=torch.float32, with_vocab=False)
    mine = {s: stages[s] for s in schedule.placement.stages_of(ctx.rank)}
    f, b, w = STAGE_MS
    costs = EmulatedCosts(f, b, w)
    placed = Costs(t_f=f, t_b=b, t_w=w, vocab=VOCAB)  # ms: the placement and the simulator read the same
    link = DistVocabLink([0, 1], (config.seq, config.hidden), torch.float32, first=0, last=S - 1)
    vocab = toy_vocab_step(ctx.rank, link, ranks=2, vocab=config.vocab, hidden=config.hidden, first=0, last=1,
                           before_pass=VocabPassTimes.from_costs(VOCAB, ms_per_unit=1.0))
    runner = PipelineRunner(schedule, mine, cross_entropy, timeout_s=60, measure_memory=False,
                            compute=EmulatedCompute(costs, mine, S, vocab_parallel=True), vocab=vocab,
                            vocab_costs=placed, record_timeline=True)
    x, y = toy_batch(m, config)
    results = [runner.step(x, y) for _ in range(steps)]
    link.close()
    if ctx.rank != 0:
        return None
    timeline = results[-1].timeline
    kinds = [[type(e.action).__name__ for e in events] for events in timeline.events]
    vocab_ms = [[(str(e.action), (e.end - e.start) * 1e3) for e in events if type(e.action) is VocabPass]
                for events in timeline.events]
    return {"makespan": timeline.makespan, "busy": [timeline.busy(r) for r in range(2)], "kinds": kinds,
            "vocab_ms": vocab_ms, "program": runner.program, "losses": results[-1].losses}


@pytest.mark.spawn
def test_emulated_vocab_step_runs_and_follows_the_simulator():
    from pipeblocks.core.simulator.simulate import simulate_program
    from pipeblocks.runtime import spawn

    m = 4
    out = spawn(_worker, 2, args=(m, 2), timeout_s=60, threads_per_rank=1)[0]
    # every rank's timeline holds its IF, S, T and IB of every microbatch beside the stages' passes
    for kinds in out["kinds"]:
        assert kinds.count("VocabPass") == 4 * m
        assert kinds.count("Action") > 0
    # each pass slept its modelled time (ms) after its input was in
    for passes in out["vocab_ms"]:
        for name, ms in passes:
            assert ms >= VocabPassTimes.from_costs(VOCAB, ms_per_unit=1.0).ms(name.rstrip("0123456789")) * 0.99, name
    # the losses of emulated passes are the toy tables' own (finite, one per microbatch)
    assert len(out["losses"]) == m
    program = out["program"]
    f, b, w = STAGE_MS
    simulated = simulate_program(program, Costs(t_f=f, t_b=b, t_w=w, vocab=VOCAB))
    ratio = out["makespan"] * 1e3 / simulated.makespan
    assert 0.5 <= ratio <= 3.0, (out["makespan"], simulated.makespan)
    for r in range(2):
        busy = out["busy"][r] * 1e3 / simulated.busy(r)
        assert 0.8 <= busy <= 3.0, (r, out["busy"], [simulated.busy(q) for q in range(2)])


@pytest.mark.spawn
def test_train_vocab_parallel_emulate_runs_and_its_report_simulates_the_passes(tmp_path):
    import json

    from test_train import _train

    from pipeblocks import schedules
    from pipeblocks.core.simulator.simulate import simulate

    report = tmp_path / "r.json"
    proc = _train("--model-family", "llama", "--layers", "4", "--hidden", "16", "--heads", "2", "--kv-heads", "1",
                  "--seq", "8", "--timeout", "60", "--vocab-parallel", "--schedule", "1f1b", "-p", "2", "-m", "4",
                  "--microbatch-size", "2", "--steps", "2", "--emulate", "2,2,2", "--report", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loss emulated" in proc.stdout, proc.stdout
    data = json.loads(report.read_text())
    assert data["emulated"]
    # the report's simulator replays the Program with its vocabulary passes: longer than the
    # stages' passes alone (2 layers per stage at 2 ms per pass per layer)
    alone = simulate(schedules.get("1f1b")(p=2, m=4), Costs(t_f=0.004, t_b=0.004, t_w=0.004)).makespan
    assert data["iteration_time_simulated_s"] > alone * 1.05, (data["iteration_time_simulated_s"], alone)
    ratio = data["iteration_time_measured_s"] / data["iteration_time_simulated_s"]
    assert 0.5 <= ratio <= 3.0, ratio
