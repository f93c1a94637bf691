"""`train --verify` for every model family: the reference GPT, the built-in Llama-style model
and Hugging Face's LlamaForCausalLM, each under 1f1b, zb-v, v-half and interleaved-1f1b at
p = 2 (float64: loss, every gradient and every weight after the step within 1e-10 of one
process), on a p = 2 x dp = 2 mesh with zero3 too, and bf16-mixed for llama under zb-v and
v-half (within `reference.TOLERANCE["bf16-mixed"]`). Every case is the check `train
--verify` makes (`train.run.judge`); the cases of one mesh run in one set of processes."""
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
    # 4 blocks: V schedules at p = 2 have 4 stages; 2 query heads share one K/V head (GQA)
    return get_family(family).config(layers=4, hidden=16, heads=2, kv_heads=None if family == "gpt" else 1, seq=8,
                                     vocab=256, dtype=dtype)


def _cases(dp: int) -> dict[str, tuple[str, str, str]]:
    cases = {f"{family}-{name}-fp64": (family, name, "fp64") for family in FAMILIES for name in SCHEDULES}
    if dp == 1:
        cases |= {f"llama-{name}-bf16-mixed": ("llama", name, "bf16-mixed") for name in ("zb-v", "v-half")}
    return {case: spec for case, spec in cases.items() if spec[0] != "hf-llama" or HAS_TRANSFORMERS}


def _runs(dp: int):
    return verify_runs(_cases(dp), _model, dp=dp)


@pytest.fixture(scope="module")
def pipeline_runs():
    return _runs(1)


@pytest.fixture(scope="module")
def mesh_runs():
    return _runs(2)


@pytest.mark.parametrize("case", list(_cases(1)))
def test_verify_at_p2(pipeline_runs, case):
    cfg, data, results = pipeline_runs[case]
    largest, tolerance, lines = judge(cfg, data, results)
    assert tolerance == (1e-10 if cfg.precision.name == "fp64" else 1e-2)
    assert largest <= tolerance, "\n".join(lines)
    if cfg.precision.mixed:  # it computed in bfloat16: its loss is not the float64 run's
        _, _, exact = pipeline_runs[case.replace("bf16-mixed", "fp64")]
        loss, exact_loss = (next(value for r in rs for _, value in r.losses) for rs in (results, exact))
        assert 1e-6 < abs(loss - exact_loss) / exact_loss < 1e-2


@pytest.mark.parametrize("case", list(_cases(2)))
def test_verify_at_p2_dp2_zero3(mesh_runs, case):
    cfg, data, results = mesh_runs[case]
    assert cfg.dp == 2 and {str(p) for p in cfg.sharding} == {"zero3"}
    largest, tolerance, lines = judge(cfg, data, results)
    assert largest <= tolerance, "\n".join(lines)


@pytest.mark.skipif(HAS_TRANSFORMERS, reason="transformers is installed: the hf-llama cases above ran")
def test_hf_llama_cases_need_transformers():
    pytest.skip("transformers is not installed (pip install -e .[hf]): the hf-llama cases were left out")
