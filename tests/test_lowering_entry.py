"""One lowering entry (`core.lowering.entry.lower_for`): every consumer holds the same Program.

For each schedule, mesh and recomputation, the Program `show --program` prints, the one
`export --format torch-comms-csv` writes, the simulator's, the runtime's, the memory
estimate's and the emulated-mesh prediction's are the same ops in the same order; a
resolved run is lowered in one place (`resolve.program.Lowering`), and `simulate`, `train`
(its ranks and its --dry-run) and the runtime hold its one Program.
"""
from __future__ import annotations

import importlib
import types

import pytest

from pipeblocks.cli.common import request_from_args
from pipeblocks.cli.main import build_parser, main
from pipeblocks.core.lowering import entry as lowering
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.core.lowering.entry import lower_for
from pipeblocks.core.ir.ops import Recompute
from pipeblocks.core.lowering.recompute import all_pairs, recompute_pairs
from pipeblocks.core.ir.sharding import parse_sharding, per_stage
from pipeblocks.core.simulator.simulate import simulate
from pipeblocks.interop import program_to_torch_csv
from pipeblocks.schedules import get
from pipeblocks.sim import memory_estimate
from pipeblocks.sim.analytic import TransformerConfig
from pipeblocks.resolve.build import build
import _emulated_mesh as emulated_mesh

simulate_module = importlib.import_module("pipeblocks.core.simulator.simulate")  # the package's name is the function

P, M = 2, 4
SCHEDULES = ("1f1b", "1f1b-r", "zb-v", "v-half", "interleaved-1f1b", "elastic")
MESHES = ((1, "replicate"), (2, "zero3"), (2, "zero1"))  # (dp, sharding)
RECOMPUTE = ("none", "all")  # --recompute; "none" leaves a -r schedule its own pairs
CONFIG = TransformerConfig(layers=8, hidden=16, heads=2, seq=8, vocab=32, microbatch_size=1, dtype="fp32",
                           flash_attention=True, dropout=False)


def _recording(monkeypatch, module) -> list:
    """Every Program `module`'s `lower_for` returns, in call order."""
    seen: list = []

    def recording(*args, **kwargs):
        program = lower_for(*args, **kwargs)
        seen.append(program)
        return program

    monkeypatch.setattr(module, "lower_for", recording)
    return seen


def _generator_options(schedule) -> tuple:
    """The options to build `schedule` again (elastic: the groups it chose, without the
    provenance it records)."""
    return tuple((k, v) for k, v in schedule.options if k in ("v", "forward_groups", "backward_groups"))


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_consumer_lowers_the_same_program(name, monkeypatch, capsys):
    from pipeblocks.runtime.runner import _lower

    simulated = _recording(monkeypatch, simulate_module)
    estimated = _recording(monkeypatch, memory_estimate)
    emulated = _recording(monkeypatch, emulated_mesh)
    for dp, sharding in MESHES:
        for recompute in RECOMPUTE:
            argv = [name, "-p", str(P), "-m", str(M), "--dp", str(dp), "--sharding", sharding, "--recompute", recompute]
            where = " ".join(argv)
            code, shown, err = _cli(capsys, "show", *argv, "--program")
            assert code == 0, f"{where}: {err}"

            built = build(request_from_args(build_parser().parse_args(["show", *argv])))
            schedule, program = built.schedule, built.program()
            assert program.to_text() == shown, where

            simulate(schedule, built.costs, recompute=built.recompute)
            assert simulated[-1].to_text() == shown, where

            policies = per_stage(parse_sharding(sharding), schedule.num_stages)
            needs_dp = dp > 1 or sharding != "replicate"
            runtime_dp = types.SimpleNamespace(policies=policies, d=dp, reduce_at_end=False, units=None) if needs_dp else None
            assert _lower(schedule, runtime_dp, recompute_pairs(schedule, built.recompute)).to_text() == shown, where

            code, csv, err = _cli(capsys, "export", *argv, "--format", "torch-comms-csv")
            recomputes = any(type(op) is Recompute for ops in program.ranks for op in ops)
            if recomputes:  # torch's CSV has no recompute action: refused, not written without it
                assert code == 2 and "no recompute action" in err and "--recompute none" in err, where
            else:
                assert code == 0, f"{where}: {err}"
                assert csv == program_to_torch_csv(program), where

            if recompute == "none":  # the estimate and the emulated mesh take the schedule's own pairs only
                memory_estimate.estimate_memory(CONFIG, schedule, dp=dp, sharding=(sharding,))
                assert estimated[-1].to_text() == shown, where
            if recompute == "none" and dp > 1:  # the emulated mesh measures DP communication: dp > 1 only
                case = emulated_mesh.EmulatedMeshCase(
                    name, p=P, dp=dp, m=M, f_ms=1, b_ms=1, w_ms=1, stage_params=(1e3,) * schedule.num_stages,
                    bandwidth=1e9, sharding=sharding, options=_generator_options(schedule),
                )
                emulated_mesh.predict_emulated_mesh(case)
                assert emulated[-1].to_text() == shown, where


def test_given_pairs_reach_the_simulator_and_the_runtime_alike(monkeypatch):
    from pipeblocks.runtime.runner import _lower

    from pipeblocks.core.cost.costs import Costs
    from pipeblocks.core.cost.dp_model import DPCostModel

    simulated = _recording(monkeypatch, simulate_module)
    schedule = get("1f1b-r")(p=P, m=M)
    pairs = frozenset({(0, 1), (1, 3)})
    zero3 = parse_sharding("zero3")
    simulate(schedule, Costs(data_parallel=DPCostModel(dp=2, sharding=zero3)), recompute=pairs)
    runtime_dp = types.SimpleNamespace(policies=per_stage(zero3, 2), d=2, reduce_at_end=False, units=None)
    program = _lower(schedule, runtime_dp, recompute_pairs(schedule, pairs))
    assert program == simulated[-1] == lower_for(schedule, policies=zero3, dp=2, recompute=pairs)
    assert {op.unit[:2] for ops in program.ranks for op in ops if type(op) is Recompute} == pairs


def test_recompute_pairs_given_or_the_schedules_own():
    plain, own = get("1f1b")(p=P, m=M), get("1f1b-r")(p=P, m=M)
    assert recompute_pairs(plain) == recompute_pairs(plain, ()) == frozenset()
    assert recompute_pairs(own) == recompute_pairs(own, ()) == all_pairs(own)
    assert recompute_pairs(own, [(0, 1)]) == recompute_pairs(plain, [[0, 1]]) == {(0, 1)}
    with pytest.raises(ScheduleError, match=r"\(2, 0\) is outside the schedule"):
        recompute_pairs(plain, [(2, 0)])


def test_reduce_at_end_and_extra_passes_keep_their_order():
    schedule = get("1f1b")(p=P, m=M)
    at_end = lower_for(schedule, dp=2, reduce_at_end=True)
    assert [str(op) for op in at_end.ranks[0][-1:]] == ["0REDUCE_GRAD"]
    marked = []

    def mark(program):
        marked.append(program)
        return program

    assert lower_for(schedule, dp=2, extra_passes=(mark,)) == marked[0] == lower_for(schedule, dp=2)
    assert lowering.__all__ == ["lower_for"]


# (schedule, options) of one run, as `simulate` and `train` both take them
ONE_RUN = {
    "1f1b": ("1f1b", ()),
    "zb-v-dp2-zero3": ("zb-v", ("--dp", "2", "--sharding", "zero3")),
    "v-half-recompute-all": ("v-half", ("--recompute", "all")),
    "zb-v-recompute-auto": ("zb-v", ("--recompute", "auto", "--gpu-memory", "17.5")),  # v-half: unit costs need 18 either way
}


def _train_config(name: str, options: tuple[str, ...]):
    from pipeblocks.cli.train import prepare_from_args

    args = build_parser().parse_args(["train", "--dry-run", "--schedule", name, "-p", str(P), "-m", str(M),
                                      "--layers", "4", "--hidden", "16", "--heads", "2", "--seq", "8",
                                      "--emulate", "1,1,1", *options])
    return prepare_from_args(args)


@pytest.mark.parametrize("run", ONE_RUN)
def test_simulate_train_and_the_runtime_run_one_program(run, monkeypatch, capsys):
    """`simulate`, `train` (what it hands the runtime, and what its --dry-run prices) and the
    runtime lowering on its own (a PipelineRunner given no program=) hold one Program."""
    from pipeblocks.resolve import program as resolve_program
    from pipeblocks.runtime.runner import _check_program, _lower
    from pipeblocks.train.prepare import run_program
    from pipeblocks.train.prepare import dp_units

    name, options = ONE_RUN[run]
    resolved = _recording(monkeypatch, resolve_program)
    code, _, err = _cli(capsys, "simulate", name, "-p", str(P), "-m", str(M), *options)
    assert code == 0, err
    simulated = resolved[-1]

    cfg, _ = _train_config(name, options)
    trained = run_program(cfg)
    assert trained.to_text() == simulated.to_text()
    s = cfg.schedule
    # the DataParallel that train.rank_setup builds, as the runner reads it
    runtime_dp = types.SimpleNamespace(policies=cfg.sharding, d=cfg.dp, reduce_at_end=False,
                                       units=dp_units(cfg)) if cfg.data_parallel else None
    assert _lower(s.schedule, runtime_dp, s.recompute, s.recompute_anchors).to_text() == simulated.to_text()
    _check_program(trained, s.schedule, runtime_dp, s.recompute, None)  # the runner takes it as given
    if "recompute" in run:
        assert s.recompute and any(type(op) is Recompute for ops in trained.ranks for op in ops)


@pytest.mark.torch
@pytest.mark.parametrize("run", ["zb-v-dp2-zero3", "v-half-recompute-all"])
def test_train_dry_run_prices_the_runs_program(run, monkeypatch, capsys):
    """`train --dry-run`'s static memory walks the Program the ranks run (chunk grain here)."""
    from pipeblocks.resolve import program as resolve_program
    from pipeblocks.train import run as training
    from pipeblocks.train.prepare import run_program

    cfg, data = _train_config(*ONE_RUN[run])
    resolved = _recording(monkeypatch, resolve_program)
    training.dry_run(cfg, data)
    capsys.readouterr()
    assert run_program(cfg).to_text() in {program.to_text() for program in resolved}


def test_the_runner_checks_a_given_program():
    from pipeblocks.runtime.runner import _check_program

    schedule = get("1f1b-r")(p=P, m=M)
    zero3 = per_stage(parse_sharding("zero3"), 2)
    runtime_dp = types.SimpleNamespace(policies=zero3, d=2, reduce_at_end=False, units=None)
    program = lower_for(schedule, policies=zero3, dp=2)
    _check_program(program, schedule, runtime_dp, recompute_pairs(schedule), None)
    with pytest.raises(ValueError, match=r"recomputes .* but recompute= gives \[\(0, 1\)\]"):
        _check_program(program, schedule, runtime_dp, frozenset({(0, 1)}), None)
    with pytest.raises(ValueError, match="no DP ops but data_parallel= runs 2 replica"):
        _check_program(lower_for(schedule), schedule, runtime_dp, None, None)
    with pytest.raises(ValueError, match="must be lowered from the schedule given"):
        _check_program(program, get("1f1b-r")(p=P, m=M), None, None, None)


@pytest.mark.spawn
def test_the_runner_runs_a_given_program_beside_its_data_parallel():
    """What `train` does: the runner handed the Program, with its DataParallel, trains as one process."""
    from pipeblocks.runtime import spawn
    from pipeblocks.train.reference import reference_update, relative_difference

    import _mesh_cases as mesh

    per_rank = spawn(mesh.matrix_worker, 4, args=(2, 2, [("zb-v", "zero3")], True), timeout_s=300,
                     threads_per_rank=1)
    x, y = mesh.global_batch(2, 0)
    _, ref_grads, _, _ = reference_update(mesh.MODEL, seed=0, inputs=x, targets=y, microbatches=2 * mesh.M,
                                          lr=mesh.LR, max_norm=None)
    for replica in range(2):
        grads = {n: g for r in per_rank for n, g in r[0]["grads"].items() if r[0]["dp_rank"] == replica}
        assert grads.keys() == ref_grads.keys()
        assert max(relative_difference(grads[n], ref_grads[n]) for n in grads) <= 1e-10
    assert any("UNSHARD" in op for r in per_rank for op in r[0]["program"])
