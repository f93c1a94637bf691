"""The trained weights back out, as a Hugging Face directory that transformers loads.

    $ pipeblocks train --hf models/qwen2 --data notes.txt --save-hf out/      # at the end of a run
    $ pipeblocks export --hf ckpt/ out/                                       # from any checkpoint

At the end of a run (`save_rank_part`, on every rank), each pipeline rank gathers its own
stages' parameters whole (FSDP2 shards over the replicas and tensor-parallel slices are
gathered within the rank's own groups; no rank gathers another's stages) and the first
replica's ranks write them, by their Hugging Face names, as one safetensors part each; the
launcher then streams the parts into the final files (`models.hf.export`). A tied head's
copy is not written: the directory holds the weight once and transformers ties it again.

`export_checkpoint` does the same from a checkpoint directory, at whatever p x dp x tp it
was saved with: per-rank checkpoints one rank's file at a time, data-parallel
(torch.distributed.checkpoint) ones one stage at a time, each stage's tensors read whole
from the shards; no process holds more than one rank's or one stage's weights.

Which models export: those whose spec has an `HFExport` (a Hugging Face directory,
hf-llama, and the built-in llama as LlamaForCausalLM); the reference GPT and a user's spec
without one are refused, named.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp

from ..models.build import stage_parameter_shapes
from ..models.config import GPTConfig
from ..models.llama_config import LlamaConfig
from . import checkpoint as ckpt
from . import sharded_checkpoint as sharded
from .corpus import tokenizer_source
from .model_choice import ModelChoice
from .prepare_checks import progress

__all__ = ["checkpoint_choice", "export_checkpoint", "finish_save", "hf_export_of", "save_rank_part"]


def hf_export_of(spec):
    """The spec's `HFExport`, or a ValueError naming the model and what exports."""
    if spec.export is None:
        raise ValueError(f"model {spec.name!r} has no Hugging Face form (its ModelSpec has no export): --save-hf and "
                         "export --hf write Hugging Face directories (--hf DIR), hf-llama and llama models")
    return spec.export


def save_rank_part(cfg, setup) -> None:
    """This rank's stages to `cfg.save_hf`'s parts (every rank calls it: the gathers are collectives)."""
    from ..models.hf.export import PARTS, write_part  # safetensors is optional: only with --save-hf
    from ..runtime.tensor_parallel import full_tensor  # DTensor is heavy: only with --save-hf

    export = hf_export_of(cfg.model.spec())
    tensors = {}
    for stage in setup.stages:
        copies = {pair.last for pair in stage.tied}
        for name, param in stage.named_parameters():
            whole = full_tensor(param).detach()
            if name not in copies:
                tensors[export.rename(name)] = whole.cpu()
    if setup.replica == 0 and setup.tp_rank == 0:
        write_part(Path(cfg.save_hf) / PARTS, f"rank-{setup.rank:05d}", tensors)


def finish_save(cfg) -> list[Path]:
    """The launcher's half of `--save-hf`: the final files, config.json and the tokenizer's files."""
    return _finish(cfg.model.spec(), cfg.save_hf, dtype=cfg.model.weights_dtype,
                   tokenizer=tokenizer_source(cfg.data, cfg.model.hf_directory), max_shard_bytes=None)


def _finish(spec, out: str, *, dtype: str, tokenizer: str | None, max_shard_bytes: int | None) -> list[Path]:
    from ..models.hf.export import DEFAULT_SHARD_BYTES, finish_hf_directory

    export = hf_export_of(spec)
    config = dict(export.config())
    for key in ("torch_dtype", "dtype"):
        if key in config or key == "dtype":
            config[key] = dtype
    return finish_hf_directory(out, config=config, tokenizer=tokenizer or export.files_from,
                               generation_config=export.files_from,
                               max_shard_bytes=max_shard_bytes or DEFAULT_SHARD_BYTES)


# ---- from a checkpoint ----------------------------------------------------------------
def checkpoint_choice(meta: Mapping[str, Any]):
    """The `ModelChoice` a checkpoint's run description names."""
    model = dict(meta["model"])
    if "source" in model:
        return ModelChoice(model["source"], None, seq=model["seq"], dtype=model["dtype"])
    family = meta.get("family", "gpt")
    config = GPTConfig.from_json(model) if family == "gpt" else LlamaConfig.from_json(model)
    return ModelChoice(family, config)


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                      max_shard_bytes: int | None = None) -> list[Path]:
    """Write the newest complete checkpoint in `checkpoint` as a Hugging Face directory `out`."""
    from ..models.hf.export import PARTS, write_part

    directory = Path(checkpoint)
    if not directory.is_dir():
        raise ValueError(f"{str(checkpoint)!r} is not a directory: give the --checkpoint directory of a run")
    parts = Path(out) / PARTS
    data_parallel = sharded.has_sharded(directory)
    if data_parallel:
        step = sharded.latest_sharded_step(directory)
        if step is None:
            raise ValueError(f"{str(directory)!r} holds no complete data-parallel checkpoint (no {sharded.MARKER})")
        meta = sharded.read_marker(directory, step)["meta"]
    else:
        check = ckpt.verify_rank(directory, 0)
        if not check.intact:
            raise ValueError(f"{str(directory)!r} holds no intact checkpoint of rank 0: give the --checkpoint "
                             "directory of a run that saved")
        meta = ckpt.load_rank(directory, rank=0, step=check.intact[-1])["meta"]
        p = int(meta["p"])
        step = ckpt.latest_step(directory, p)
        if step is None:
            raise ValueError(f"{str(directory)!r} holds no step that every one of its {p} ranks saved: nothing to "
                             "export")
    choice = checkpoint_choice(meta)
    spec = choice.spec()
    export = hf_export_of(spec)
    num_stages = len(meta["placement"])
    if data_parallel:
        for s in range(num_stages):
            progress(f"export: stage {s + 1}/{num_stages} of step {step} (torch.distributed.checkpoint)")
            write_part(parts, f"stage-{s:05d}", _renamed(export, _sharded_stage(spec, choice, directory, step, s,
                                                                                num_stages)))
    else:
        # the stages' parameters: no tied copy, no buffer a stage's state also holds
        weights = {name for s in range(num_stages) for name in stage_parameter_shapes(spec, num_stages, s)}
        for rank in range(p):
            progress(f"export: rank {rank + 1}/{p} of step {step}")
            state = ckpt.load_rank(directory, rank=rank, step=step)
            tensors = {name: t for stage in state["stages"].values() for name, t in stage.items() if name in weights}
            write_part(parts, f"rank-{rank:05d}", _renamed(export, tensors))
            del state
    return _finish(spec, str(out), dtype=choice.weights_dtype, tokenizer=meta.get("tokenizer") or choice.hf_directory,
                   max_shard_bytes=max_shard_bytes)


def _renamed(export, tensors: Mapping[str, Any]) -> dict:
    return {export.rename(name): tensor for name, tensor in tensors.items()}


def _sharded_stage(spec, choice, directory: Path, step: int, stage: int, num_stages: int) -> dict:
    """Stage `stage`'s parameters whole, read from a torch.distributed.checkpoint step (tied copies left out)."""
    dtype = getattr(torch, choice.weights_dtype)
    shapes = stage_parameter_shapes(spec, num_stages, stage)
    model = {f"stage{stage}.{name}": torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    with warnings.catch_warnings():  # one process reads the shards on purpose: no process group is wanted
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": model}, checkpoint_id=str(sharded.step_path(directory, step)), no_dist=True)
    return {key.split(".", 1)[1]: tensor for key, tensor in model.items()}
