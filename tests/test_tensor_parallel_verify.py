"""`train --verify` under tensor parallelism: tp = 2 x pp = 2 for every model family (gpt,
llama, hf-llama) under 1f1b, zb-v (split B/W), v-half and interleaved-1f1b, in float64
(loss, every gradient and every weight after the step within 1e-10 of one process), and
llama under bf16-mixed (`reference.TP_BF16_TOLERANCE`); and tp = 2 x pp = 2 x dp = 2 with
zero3 (8 processes). The cases of one mesh run in one set of processes."""
from __future__ import annotations

import importlib.util

import pytest

from pipeblocks.models.family import get_family
from pipeblocks.train.run import judge

from _family_cases import verify_runs

pytestmark = pytest.mark.spawn

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
FAMILIES = ("gpt", "llama", "hf-llama")
SCHEDULES = ("1f1b", "zb-v", "v-half", "interleaved-1f1b")


def _model(family: str, dtype: str):
    # 4 blocks: V schedules at p = 2 have 4 stages; 2 query heads and 2 K/V heads: one of each per tp rank
    return get_family(family).config(layers=4, hidden=16, heads=2, kv_heads=None, seq=8, vocab=256, dtype=dtype)


def _cases(dp: int) -> dict[str, tuple[str, str, str]]:
    if dp == 1:
        cases = {f"{family}-{name}-fp64": (family, name, "fp64") for family in FAMILIES for name in SCHEDULES}
        cases["llama-zb-v-bf16-mixed"] = ("llama", "zb-v", "bf16-mixed")
    else:
        cases = {"llama-zb-v-fp64": ("llama", "zb-v", "fp64"), "gpt-1f1b-fp64": ("gpt", "1f1b", "fp64")}
    return {case: spec for case, spec in cases.items() if spec[0] != "hf-llama" or HAS_TRANSFORMERS}


def _runs(dp: int):
    return verify_runs(_cases(dp), _model, dp=dp, tp=2)


@pytest.fixture(scope="module")
def tp_runs():
    return _runs(1)


@pytest.fixture(scope="module")
def tp_mesh_runs():
    return _runs(2)


@pytest.mark.parametrize("case", list(_cases(1)))
def test_verify_at_p2_tp2(tp_runs, case):
    cfg, data, results = tp_runs[case]
    assert cfg.tp == 2 and cfg.world_size == 4 and sorted(r.tp_rank for r in results) == [0, 0, 1, 1]
    largest, tolerance, lines = judge(cfg, data, results)
    assert tolerance == (1e-10 if cfg.precision.name == "fp64" else 3e-2)
    assert largest <= tolerance, "\n".join(lines)
    # every tp rank of the last stage computed the whole loss, the same one
    losses = {value for r in results for _, value in r.losses}
    assert len(losses) == 1


@pytest.mark.parametrize("case", list(_cases(2)))
def test_verify_at_p2_dp2_tp2_zero3(tp_mesh_runs, case):
    cfg, data, results = tp_mesh_runs[case]
    assert cfg.world_size == 8 and {str(p) for p in cfg.sharding} == {"zero3"}
    largest, tolerance, lines = judge(cfg, data, results)
    assert largest <= tolerance, "\n".join(lines)
