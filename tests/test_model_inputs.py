"""Bad input to `pipeblocks train --hf / --model / --data` gets one clear line and exit 2,
before any process starts: a directory without config.json or weights, an unsupported
architecture, pickled weights only, a tensor missing or of another shape, size options with
--hf or --model, a tokenizer larger than the model's vocabulary, a token id beyond it,
--model naming nothing or not a ModelSpec. `register_model` names travel to the ranks."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from pipeblocks.cli.main import main

from _hf_dirs import make_model_dir

pytestmark = pytest.mark.torch
pytest.importorskip("transformers", reason="needs transformers (pip install -e .[hf])")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("hf") / "llama", "LlamaForCausalLM")


def _refused(capsys, args: list[str], *patterns: str) -> str:
    assert main(["train", *args]) == 2  # found by prepare: nothing is launched
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for pattern in patterns:
        assert pattern in err, err
    return err


def _copy(llama, tmp_path, name: str):
    target = tmp_path / name
    shutil.copytree(llama, target)
    return target


def test_directory_problems_are_named(capsys, llama, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(capsys, ["--hf", str(empty)], "holds no config.json")
    no_weights = _copy(llama, tmp_path, "no-weights")
    (no_weights / "model.safetensors").unlink()
    _refused(capsys, ["--hf", str(no_weights)], "holds no weights")
    pickled = _copy(llama, tmp_path, "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    _refused(capsys, ["--hf", str(pickled)], "only pickled weights", "safe_serialization=True")
    other = _copy(llama, tmp_path, "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    _refused(capsys, ["--hf", str(other)], "'MambaForCausalLM'", "LlamaForCausalLM, MistralForCausalLM",
             "write a ModelSpec")


def test_weights_that_do_not_fit_the_config_are_named(capsys, llama, tmp_path):
    from safetensors.torch import load_file, save_file

    missing = _copy(llama, tmp_path, "missing")
    tensors = load_file(str(missing / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.up_proj.weight"},
              str(missing / "model.safetensors"), metadata={"format": "pt"})
    _refused(capsys, ["--hf", str(missing)], "lack the tensor model.layers.2.mlp.up_proj.weight")
    shaped = _copy(llama, tmp_path, "shaped")
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:8]
    save_file(tensors, str(shaped / "model.safetensors"), metadata={"format": "pt"})
    _refused(capsys, ["--hf", str(shaped)], "model.layers.1.self_attn.k_proj.weight has shape [8, 32]",
             "expects [16, 32]")


def test_size_options_with_hf_or_model_are_refused(capsys, llama):
    _refused(capsys, ["--hf", str(llama), "--layers", "8", "--hidden", "64"],
             "--layers, --hidden with --hf", "config.json")
    _refused(capsys, ["--model", "tests/_user_spec.py:SPEC", "--vocab", "512"], "--vocab with --model")


def test_data_that_does_not_fit_the_model_is_refused(capsys, llama, tmp_path):
    from _hf_dirs import save_tokenizer, train_tokenizer

    big = save_tokenizer(tmp_path / "big", train_tokenizer(vocab=400))  # the model's vocabulary is 320
    _refused(capsys, ["--hf", str(llama), "--tokenizer", str(big)], "400", "320")
    ids = tmp_path / "ids.bin"
    np.array([1, 2, 3, 999, 4] * 100, dtype=np.uint16).tofile(ids)
    _refused(capsys, ["--hf", str(llama), "--data", str(ids)], "token id 999", "320")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    _refused(capsys, ["--data", str(odd)], "odd.bin")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _refused(capsys, ["--data", str(empty)], "empty")
    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"text": "one"}\n{"body": "two"}\n')
    _refused(capsys, ["--hf", str(llama), "--data", str(lines)], "line 2", "--data-field")


def test_model_references_that_name_no_spec(capsys, tmp_path):
    spec_file = tmp_path / "mine.py"
    spec_file.write_text("SPEC = 42\n")
    _refused(capsys, ["--model", f"{spec_file}:MISSING"], "has no 'MISSING'")
    _refused(capsys, ["--model", f"{spec_file}:SPEC"], "is a int, not a ModelSpec")
    _refused(capsys, ["--model", str(tmp_path / "none.py") + ":SPEC"], "no file")
    _refused(capsys, ["--model", "no-such-model"], "no model is registered by that name")


def test_a_user_spec_trains_from_a_file_and_by_a_registered_name(capsys):
    assert main(["train", "--model", "tests/_user_spec.py:SPEC", "-p", "2", "--dry-run"]) == 0
    assert "4-layer tiny-lm (hidden 32, 4 heads)" in capsys.readouterr().out
    from pipeblocks.models.spec import load_spec, portable_reference

    import _user_spec  # registers "tiny-lm" on import

    assert portable_reference("tiny-lm") == "tiny-lm@_user_spec" and load_spec("tiny-lm@_user_spec") is _user_spec.SPEC
