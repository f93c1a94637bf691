"""Block grain's overlap in the runtime, on p=1 x d=2 (one set of two processes): each
unit's reduction is launched inside its stage's last weight-gradient pass as soon as the
unit's gradients are complete (a fused BW under 1f1b, a split W under zb-v; FSDP2 units
under zero2 and zero3, gradient buckets under replicate and zero1), and the next step's
first gathers are issued as soon as the chunk's optimizer step is done. Read from the
DataParallel's event log; three steps equal, bit for bit, the same steps without gathering
ahead, and the first equals one process."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.spawn

# (schedule, policy, every REDUCE_GRAD at the end of the step)
CASES = [("1f1b", "zero3", False), ("zb-v", "zero3", False), ("1f1b", "zero2", False),
         ("zb-v", "replicate", False), ("zb-v", "zero1", False), ("zb-v", "zero3", True)]
IDS = ["-".join([name, policy] + (["at-end"] if at_end else [])) for name, policy, at_end in CASES]


@pytest.fixture(scope="module")
def runs():
    from pipeblocks.runtime import spawn

    from _dp_overlap_cases import overlap_worker

    per_rank = spawn(overlap_worker, 2, args=(CASES,), timeout_s=300, threads_per_rank=1)
    return {case: [rank[i] for rank in per_rank] for i, case in enumerate(CASES)}


def _stages(program: list[str]) -> list[int]:
    return sorted({int(op.split("REDUCE_GRAD.")[0]) for op in program if "REDUCE_GRAD." in op})


@pytest.mark.parametrize("case", [c for c in CASES if not c[2]], ids=[i for c, i in zip(CASES, IDS) if not c[2]])
def test_each_unit_reduction_launches_inside_the_last_weight_pass(runs, case):
    for result in runs[case]:
        run = result["on"]
        for step, events in enumerate(run["steps"]):
            assert not [e for e in events if e[0] == "reduce_at_op"], (case, step, events)
            for stage in _stages(run["program"]):
                launched = [(unit, t) for kind, s, unit, t in events if kind == "reduce_in_pass" and s == stage]
                end = next(t for kind, s, _, t in events if kind == "pass_end" and s == stage)
                units = [unit for unit, _ in launched]
                # a backward completes the blocks in reverse: the last unit first
                assert units == sorted(units, reverse=True) and len(units) >= 2, (case, step, stage, events)
                # the first finished unit's reduction is in flight while the pass still runs
                assert launched[0][1] < launched[-1][1] < end, (case, step, stage, events)


def test_reductions_of_a_stage_whose_reduce_grads_are_not_behind_its_weight_pass_wait_for_them(runs):
    """--reduce-at-end (zb-v on one rank: 0W1 ends the step, then 0REDUCE_GRAD.1 0REDUCE_GRAD.0
    1REDUCE_GRAD.1 1REDUCE_GRAD.0): stage 0's follow its last weight pass and launch inside
    it; stage 1's do not, and launch at their ops, in the Program's order."""
    for result in runs[("zb-v", "zero3", True)]:
        for events in result["on"]["steps"]:
            assert [(e[1], e[2]) for e in events if e[0] == "reduce_in_pass"] == [(0, 1), (0, 0)], events
            assert [(e[1], e[2]) for e in events if e[0] == "reduce_at_op"] == [(1, 1), (1, 0)], events


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "zero3"],
                         ids=[i for c, i in zip(CASES, IDS) if c[1] == "zero3"])
def test_the_next_steps_first_gathers_are_issued_after_the_optimizer_step(runs, case):
    for result in runs[case]:
        run = result["on"]
        opening = run["program"][:next(i for i, op in enumerate(run["program"]) if "UNSHARD." not in op)]
        leading = [tuple(int(x) for x in op.split("UNSHARD.")) for op in opening]
        assert len(leading) >= 2, run["program"]
        steps = run["steps"]
        for step, events in enumerate(steps):
            ahead = [(e[1], e[2], e[3]) for e in events if e[0] == "gather_ahead"]
            assert [(s, u) for s, u, _ in ahead] == leading, (case, step, events)
            last_pass = max(t for kind, _, _, t in events if kind == "pass_end")
            assert all(t > last_pass for _, _, t in ahead), (case, step, events)
            if step + 1 < len(steps):
                following = steps[step + 1]
                start = following[0]
                assert start[0] == "step_start" and max(t for *_, t in ahead) < start[3], (case, step)
                # the next step's UNSHARDs find every one of them in flight, before its first pass
                found = [(e[1], e[2]) for e in following if e[0] == "unshard_found_ahead"]
                assert found == leading, (case, step, following)
        # the last step's gathers are in flight: the state dict (a checkpoint) is sharded
        assert run["sharded_state"] and run["sharded_after_drop"], case
        off = result["off"]
        assert not [e for events in off["steps"] for e in events if e[0] in ("gather_ahead", "unshard_found_ahead")]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_three_steps_equal_those_without_gathering_ahead_and_one_process(runs, case):
    import torch

    from pipeblocks.train.reference import reference_update, relative_difference

    from _dp_overlap_cases import LR, M, MODEL, global_batch

    x, y = global_batch(2, 0)
    _, ref_grads, ref_params, _ = reference_update(MODEL, seed=0, inputs=x, targets=y, microbatches=2 * M, lr=LR,
                                                   max_norm=None)
    for result in runs[case]:
        on, off = result["on"], result["off"]
        assert on["losses"] == off["losses"], case
        for got, want in zip(on["params"], off["params"]):
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), case
        assert on["grads"].keys() == ref_grads.keys()
        assert max(relative_difference(on["grads"][k], ref_grads[k]) for k in ref_grads) <= 1e-10, case
        assert max(relative_difference(on["params"][0][k], ref_params[k]) for k in ref_params) <= 1e-10, case
