"""`train --hf DIR --verify` for every supported architecture, from tiny model directories
made here: Llama, Mistral, Qwen2, Qwen3 and Gemma (whose head is tied to its embedding),
and a Qwen2 with a tied head. Float64: the loss, every gradient (both copies of a tied
weight against the one weight of transformers' own tied model) and every weight after the
step within 1e-10 of one process. At p = 2 under 1f1b, zb-v, v-half and interleaved-1f1b
(a tied pair on two ranks under the looped schedules, on one rank under the V ones); on a
p = 2 x dp = 2 mesh with zero3; and with --tp 2, where Gemma agrees to float32's rounding
(1e-5): transformers' GemmaRMSNorm computes in float32 whatever the model's dtype, and tensor
parallelism splits its weight gradient's sum over tokens between the ranks. The cases of one mesh run in one set of
processes, as `train --verify` would run them one after another (`_family_cases`)."""
from __future__ import annotations

import pytest

from pipeblocks.train.model_choice import HF_PREFIX, ModelChoice
from pipeblocks.train.run import judge

from _family_cases import verify_runs
from _hf_dirs import ARCHITECTURES, make_model_dir

pytestmark = pytest.mark.spawn
pytest.importorskip("transformers", reason="Hugging Face models need transformers (pip install -e .[hf])")

SCHEDULES = ("1f1b", "zb-v", "v-half", "interleaved-1f1b")
MODELS = {**{name: (name, name.startswith("Gemma")) for name in ARCHITECTURES},
          "Qwen2ForCausalLM-tied": ("Qwen2ForCausalLM", True)}
SEQ = 8


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {key: make_model_dir(root / key, arch, tied=tied, layers=4)
            for key, (arch, tied) in MODELS.items()}


def _runs(directories, cases: dict[str, tuple[str, str]], *, dp: int = 1, tp: int = 1):
    def model(key: str, dtype: str):
        return ModelChoice(HF_PREFIX + str(directories[key]), None, seq=SEQ, dtype=dtype)

    return verify_runs({case: (key, name, "fp64") for case, (key, name) in cases.items()}, model, dp=dp, tp=tp)


PIPELINE = {f"{key}-{name}": (key, name) for key in MODELS for name in SCHEDULES}
MESH = {**{f"{key}-1f1b": (key, "1f1b") for key in MODELS}, "GemmaForCausalLM-zb-v": ("GemmaForCausalLM", "zb-v"),
        "Qwen2ForCausalLM-tied-zb-v": ("Qwen2ForCausalLM-tied", "zb-v")}
TENSOR = dict(MESH)


@pytest.fixture(scope="module")
def pipeline_runs(directories):
    return _runs(directories, PIPELINE)


@pytest.fixture(scope="module")
def mesh_runs(directories):
    return _runs(directories, MESH, dp=2)


@pytest.fixture(scope="module")
def tensor_runs(directories):
    return _runs(directories, TENSOR, tp=2)


def _check(run) -> None:
    cfg, data, results = run
    largest, tolerance, lines = judge(cfg, data, results)
    float32_norms = cfg.tp > 1 and cfg.model.shape.tied and "Gemma" in cfg.model.source
    assert tolerance == (1e-5 if float32_norms else 1e-10)
    assert largest <= tolerance, "\n".join(lines)


@pytest.mark.parametrize("case", list(PIPELINE))
def test_verify_at_p2(pipeline_runs, case):
    cfg = pipeline_runs[case][0]
    assert cfg.model.family == "hf" and cfg.model.shape.tied == case.startswith(("Gemma", "Qwen2ForCausalLM-tied"))
    _check(pipeline_runs[case])


@pytest.mark.parametrize("case", list(MESH))
def test_verify_at_p2_dp2_zero3(mesh_runs, case):
    cfg = mesh_runs[case][0]
    assert cfg.dp == 2 and {str(p) for p in cfg.sharding} == {"zero3"}
    _check(mesh_runs[case])


@pytest.mark.parametrize("case", list(TENSOR))
def test_verify_at_p2_tp2(tensor_runs, case):
    assert tensor_runs[case][0].tp == 2
    _check(tensor_runs[case])
