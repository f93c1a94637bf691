"""benchmarks/pipemesh.py --sweep on a tiny grid: the shares it reports agree with the step
and exposure figures beside them, and the floor bounds what elastic removes."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# 1.5b at p = 2, m = 8: a fraction of a second per point; 40 GB/s puts depth-first at 29% idle
TINY = ["--sweep", "-p", "2", "-m", "8", "--models", "1.5b", "--sweep-v", "2", "--sweep-bandwidth", "20", "40",
        "--sweep-microbatch", "1", "--sweep-sharding", "zero3", "ends=replicate"]


@pytest.fixture(scope="module")
def pipemesh():
    spec = importlib.util.spec_from_file_location("pipemesh_benchmark", BENCHMARKS / "pipemesh.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))  # its helpers beside it, as when run as a script
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("_pipemesh_sweep", None)


@pytest.fixture(scope="module")
def sweep(pipemesh, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    assert pipemesh.main([*TINY, "--json", str(out / "sweep.json"), "--plot", str(out / "sweep.png")]) == 0
    return json.loads((out / "sweep.json").read_text()), out


def test_sweep_covers_the_grid(sweep):
    data, out = sweep
    rows = data["rows"]
    assert [(r["bandwidth"], r["sharding"]) for r in rows] == [
        (20.0, "zero3"), (40.0, "zero3"), (20.0, "ends=replicate"), (40.0, "ends=replicate")]
    assert all((r["model"], r["v"], r["dp"], r["microbatch"], r["latency"]) == ("1.5b", 2, 16, 1, 30.0) for r in rows)
    assert (out / "sweep.png").stat().st_size > 0


def test_shares_agree_with_the_figures(sweep):
    for r in sweep[0]["rows"]:
        depth, elastic = r["depth-first"], r["elastic"]
        assert depth["exposed_s"] > 0  # a slow link: there is idle time to remove
        assert r["idle_share"] == pytest.approx(depth["exposed_s"] / depth["step_s"])
        assert 0 < r["idle_share"] < 1
        assert r["removed_share"] == pytest.approx(1 - elastic["exposed_s"] / depth["exposed_s"])
        assert r["removable_share"] == pytest.approx(1 - r["floor_s"] / depth["exposed_s"])
        assert 0 <= r["removed_share"] <= 1
        fitting = [r[k]["step_s"] for k in ("depth-first", "breadth-first") if r[k]["fits"]]
        assert r["gain"] == pytest.approx(min(fitting) / elastic["step_s"])
        assert r["in_regime"] == (0.20 <= r["idle_share"] <= 0.35)
        assert r["target_met"] == (r["gain"] >= 1.15 and r["removed_share"] >= 0.60)


def test_floor_bounds_what_is_removed(sweep):
    """Rank 0 waits for its first chunk's gather before its first pass and for its
    reduction after its last in every order: no order exposes less than that floor."""
    for r in sweep[0]["rows"]:
        edges = {k: r[k]["rank0_edges"] for k in ("depth-first", "breadth-first", "elastic")}
        assert r["floor_s"] == pytest.approx(min(e["lead_s"] + e["tail_s"] for e in edges.values()))
        for label, e in edges.items():
            assert e["lead_s"] + e["tail_s"] <= r[label]["exposed_per_rank_s"][0] + 1e-12
            assert e["first_pass"]["action"] == "0F0"
        assert r["floor_s"] <= r["elastic"]["exposed_s"] + 1e-12
        assert r["removed_share"] <= r["removable_share"] + 1e-12
        assert r["gain"] <= r["gain_bound"] + 1e-12
        # a replicated stage 0 is not gathered: rank 0 waits only at the end, for its all-reduce
        if r["sharding"] == "ends=replicate":
            assert edges["elastic"]["lead_s"] == 0 and not edges["elastic"]["lead_ops"]
        else:
            assert {o["kind"] for o in edges["elastic"]["lead_ops"]} == {"UNSHARD"}
        assert {(o["stage"], o["kind"]) for o in edges["elastic"]["tail_ops"]} == {(0, "REDUCE_GRAD")}


def test_summary_counts_the_regime(sweep):
    data = sweep[0]
    inside = [r for r in data["rows"] if r["in_regime"]]
    summary = data["summary"]
    assert summary["points"] == len(inside) >= 1
    best = summary["best_removed_share"]
    assert best["removed_share"] == max(r["removed_share"] for r in inside)
    assert summary["target_met"] == [] or all(p["gain"] >= 1.15 for p in summary["target_met"])


def test_mixed_sharding_labels(pipemesh):
    from _pipemesh_sweep import sharding_policies

    def names(label: str, stages: int, p: int = 2) -> list[str]:
        return [str(policy) for policy in sharding_policies(label, stages, p)]

    assert names("ends=replicate", 4) == ["replicate", "zero3", "zero3", "replicate"]
    assert names("first=zero1", 4) == ["zero1", "zero3", "zero3", "zero3"]
    assert names("firsts=replicate", 6, p=3) == ["replicate"] * 3 + ["zero3"] * 3
    assert names("zero2", 3) == ["zero2"] * 3
    assert names("replicate,zero3", 2) == ["replicate", "zero3"]
    with pytest.raises(ValueError, match="ends|first|firsts=POLICY"):
        sharding_policies("middle=zero1", 4, 2)
    with pytest.raises(ValueError, match="policies but the schedule has 4"):
        sharding_policies("replicate,zero3", 4, 2)


def test_table_prints_with_json(pipemesh, capsys, tmp_path):
    assert pipemesh.main([*TINY[:-1], "--sweep-bandwidth", "40", "--json", str(tmp_path / "s.json")]) == 0
    table = capsys.readouterr().out
    assert "removed" in table and "max rm" in table and "where depth-first idles 20%-35%" in table
    assert "rank 0 waits" in table


def test_match_idle_maps_a_point_onto_the_emulated_mesh(pipemesh):
    """--emulated --match-idle: the link at which the simulator puts the emulated
    depth-first at a sweep point's idle share (simulated only; nothing is launched)."""
    import argparse

    from _emulated_mesh import predict_emulated_mesh

    args = argparse.Namespace(m=8, emulate_ms=20.0, stage_params=12e6, v=2, emulated_sharding="zero3", steps=4,
                              forward_groups="8", backward_groups="2,6", blocks=1, dp_unit="chunk", prefetch=None)
    gbs = pipemesh.bandwidth_for_idle(args, 0.27)
    depth, _, elastic = (predict_emulated_mesh(case) for case in pipemesh.emulated_cases(args, gbs))
    assert depth["exposed_s"] / depth["step_s"] == pytest.approx(0.27, abs=1e-6)
    # one chunk's gather before rank 0's first pass and its reduce-scatter after its last: a
    # chunk of 12e6 fp32 parameters, half of it over the link each way at d = 2
    assert elastic["exposed_s"] == pytest.approx(2 * 12e6 * 4 / 2 / (gbs * 1e9), rel=1e-6)
    with pytest.raises(ValueError, match="give one in between"):
        pipemesh.bandwidth_for_idle(args, 0.999)
    with pytest.raises(ValueError, match="s a step on its .* link .* give a smaller share"):
        pipemesh.bandwidth_for_idle(args, 0.95)  # reachable, but only on a link far too slow to run
