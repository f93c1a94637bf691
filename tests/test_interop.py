"""Interop with torch.distributed.pipelining: the compute-only CSV, both ways.

Torch's own loader must accept every exported schedule, and a schedule exported by us and
run by torch's runtime on gloo must give the gradients of one process running the model.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import types

import pytest

from pipeblocks.core import ScheduleError, validate
from pipeblocks.core.ir.schedule import Schedule
from pipeblocks.interop import from_torch_csv, to_torch_csv
from pipeblocks.schedules import get

torch = pytest.importorskip("torch")
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime  # noqa: E402

pytestmark = pytest.mark.spawn

EXPORTED = [
    ("zb-h1", {}), ("zb-h2", {}), ("zb", {}), ("zb-1p", {}), ("zb-2p", {}), ("zb-v", {}),
    ("zb-v", {"cost_aware": True}), ("1f1b", {}), ("gpipe", {}), ("interleaved-1f1b", {}),
]


def _torch_load(text: str, p: int, num_stages: int, m: int) -> _PipelineScheduleRuntime:
    """Run torch's CSV loader (validation, stage mapping, comm lowering) on one rank's view."""
    stage = types.SimpleNamespace(
        num_stages=num_stages, group_size=p, group_rank=0, stage_index_to_group_rank=None
    )
    runtime = _PipelineScheduleRuntime([stage], m)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "schedule.csv")
        with open(path, "w") as handle:
            handle.write(text)
        runtime._load_csv(path, format="compute_only")
    return runtime


def test_names_map_to_torch():
    text = to_torch_csv(get("zb-h1")(p=2, m=2))
    assert text.splitlines()[1] == "1F0,1I0,1F1,1I1,1W0,1W1"
    assert to_torch_csv(get("1f1b")(p=2, m=2)).splitlines()[1] == "1F0,1B0,1F1,1B1"
    v = to_torch_csv(get("zb-v")(p=2, m=1)).splitlines()
    assert v == ["0F0,3F0,3I0,3W0,0I0,0W0", "1F0,2F0,2I0,2W0,1I0,1W0"]


@pytest.mark.parametrize("name,options", EXPORTED)
@pytest.mark.parametrize("p,m", [(2, 3), (4, 8), (4, 6), (3, 2)])
def test_torch_loader_accepts_export_and_round_trips(name, options, p, m):
    schedule = get(name)(p=p, m=m, **options)
    text = to_torch_csv(schedule)
    runtime = _torch_load(text, p, schedule.num_stages, m)
    expected = {s: r for s, r in enumerate(schedule.placement.stage_to_rank)}
    assert runtime.stage_index_to_group_rank == expected
    assert [str(a) for a in runtime.pipeline_order[1] if a is not None] == text.splitlines()[1].split(",")
    back = from_torch_csv(text)
    assert back.ranks == schedule.ranks and back.placement == schedule.placement
    validate(back)


def test_torch_lowering_rejects_a_cyclic_order_we_also_reject():
    # rank 1 waits for 1F1 before running 1BW0; rank 0 sends 0F1 only after 0BW0: a cycle
    bad = Schedule.from_text("0: 0F0 0BW0 0F1 0BW1\n1: 1F0 1F1 1BW0 1BW1\n")
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(bad)
    with pytest.raises(Exception, match="Malformed compute schedule"):
        _torch_load(to_torch_csv(bad), 2, 2, 2)


def test_import_handles_idle_cells_overlap_and_rejects_comms():
    text = "0F0,,0F1,(0I0;0W0)OVERLAP_F_B,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n"
    schedule = from_torch_csv(text)
    assert [str(a) for a in schedule.ranks[0]] == ["0F0", "0F1", "0B0", "0W0", "0B1", "0W1"]
    validate(schedule)
    with pytest.raises(ScheduleError, match="not a compute action"):
        from_torch_csv("0F0,0SEND_F0\n1RECV_F0,1F0\n")
    with pytest.raises(ScheduleError, match="2 rows but p=3"):
        from_torch_csv(text, p=3)
    assert from_torch_csv(text, m=5).m == 5


def test_export_rejects_sequence_chunks():
    seq = Schedule.from_text("# pipeblocks schedule s p=1 m=1 placement=loop stages=0 seq_chunks=2\n0: 0F0.0 0F0.1 0BW0.1 0BW0.0\n")
    with pytest.raises(ScheduleError, match="no sequence chunks"):
        to_torch_csv(seq)


def test_interop_module_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, pipeblocks.interop; print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# ---- torch's runtime on gloo, 2 processes ---------------------------------------------------

WIDTH, BLOCKS, BATCH = 6, 4, 2


def _blocks():
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()).double() for _ in range(BLOCKS)]


def _data(m):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(m * BATCH, WIDTH, generator=gen, dtype=torch.float64),
            torch.randn(m * BATCH, WIDTH, generator=gen, dtype=torch.float64))


def _loss(output, target):
    return ((output - target) ** 2).sum()


def _stage_modules(num_stages):
    blocks = _blocks()
    per = BLOCKS // num_stages
    return [torch.nn.Sequential(*blocks[s * per:(s + 1) * per]) for s in range(num_stages)]


def _worker(rank, world, init_file, folder, cases):
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    try:
        for label, text, num_stages, m in cases:
            modules = _stage_modules(num_stages)
            mine = [s for s in range(num_stages) if _rank_in(text, s) == rank]
            stages = [PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in mine]
            runtime = _PipelineScheduleRuntime(stages, m, loss_fn=_loss)
            path = os.path.join(folder, f"{label}.csv")
            if rank == 0:
                with open(path, "w") as handle:
                    handle.write(text)
            dist.barrier()
            runtime._load_csv(path, format="compute_only")
            x, y = _data(m)
            runtime.step(x, target=y)
            grads = {s: [p.grad.clone() for p in modules[s].parameters()] for s in mine}
            torch.save(grads, os.path.join(folder, f"{label}-rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _rank_in(text: str, stage: int) -> int:
    for rank, row in enumerate(text.splitlines()):
        if any(cell.startswith(f"{stage}") and cell[len(str(stage))].isalpha() for cell in row.split(",")):
            return rank
    raise AssertionError(f"stage {stage} not in the CSV")


def test_torch_runtime_on_gloo_matches_one_process():
    import torch.multiprocessing as mp

    m = 3
    cases = [
        ("zb-h1", to_torch_csv(get("zb-h1")(p=2, m=m)), 2, m),
        ("zb-v", to_torch_csv(get("zb-v")(p=2, m=m)), 4, m),
        ("zb-2p", to_torch_csv(get("zb-2p")(p=2, m=m)), 2, m),
        # overlapped pairs as torch's (F;B)OVERLAP_F_B cells, run one part after the other
        ("dualpipev", to_torch_csv(get("dualpipev")(p=2, m=4)), 4, 4),
    ]
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        context = mp.spawn(_worker, args=(2, init_file, folder, cases), nprocs=2, join=False)
        deadline = 60.0
        waited = 0.0
        while not context.join(timeout=5):
            waited += 5
            if waited >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                pytest.fail("gloo run did not finish in 60 s")
        for label, _, num_stages, m in cases:
            got = {}
            for rank in range(2):
                got.update(torch.load(os.path.join(folder, f"{label}-rank{rank}.pt")))
            modules = _stage_modules(num_stages)
            x, y = _data(m)
            model = torch.nn.Sequential(*modules)
            total = sum(_loss(model(xc), yc) for xc, yc in zip(x.chunk(m), y.chunk(m))) / m
            total.backward()
            assert sorted(got) == list(range(num_stages))
            for s in range(num_stages):
                for mine, ref in zip(got[s], modules[s].parameters()):
                    torch.testing.assert_close(mine, ref.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,policy", [("zb-v", "zero3"), ("interleaved-1f1b", "replicate"), ("1f1b", "zero2"),
                                         ("dualpipev", "zero3")])
def test_lowered_csv_carries_dp_ops_through_torch_and_back(name, policy):
    from pipeblocks.core import parse_sharding
    from pipeblocks.core.lowering.entry import lower_for
    from pipeblocks.interop import program_from_torch_csv, program_to_torch_csv

    schedule = get(name)(p=2, m=4)
    program = lower_for(schedule, policies=parse_sharding(policy), dp=2)
    text = program_to_torch_csv(program)
    assert "REDUCE_GRAD" in text and ("UNSHARD" in text) == (policy == "zero3")
    stage = types.SimpleNamespace(num_stages=schedule.num_stages, group_size=2, group_rank=0,
                                  stage_index_to_group_rank=None)
    runtime = _PipelineScheduleRuntime([stage], 4)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "lowered.csv")
        with open(path, "w") as handle:
            handle.write(text)
        runtime._load_csv(path, format="compute_comms")
    for rank in range(2):  # torch parses every cell into the same op, in order
        assert [str(a) for a in runtime.pipeline_order_with_comms[rank]] == text.splitlines()[rank].split(",")
    back = program_from_torch_csv(text, name=schedule.name)
    assert back.ranks == program.ranks and back.schedule.placement == schedule.placement
