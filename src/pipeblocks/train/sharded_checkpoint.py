"""Checkpoints of a data-parallel run through torch.distributed.checkpoint (DCP).

    DIR/dcp-step00000010/        one DCP checkpoint per saved step (every rank's shards)
    DIR/dcp-step00000010/COMPLETE.json   the step and the run description, written last
    DIR/.dcp-step00000010.tmp/   a save under way (renamed into place when complete)

    >>> save_sharded(ckpt_dir, step=10, stages=stages, optimizers=opts, meta=meta)  # every rank
    >>> step = latest_sharded_step(ckpt_dir)
    >>> load_sharded(ckpt_dir, step=step, stages=stages, optimizers=opts)          # every rank

Every process of the mesh takes part in a save and a load (they are collectives on the
default group). The state is that of `get_state_dict`/`set_state_dict`
(torch.distributed.checkpoint.state_dict) over a module dict `stage<s>` -> chunk, with
the optimizer state flattened to one entry per parameter name: keys do not depend on the
rank, FSDP2 and tensor-parallel parameters and their optimizer state are saved as DTensor
shards (a tensor-parallel rank's rows or columns, a replica's FSDP2 rows of those), replicated
tensors once. ZeroRedundancyOptimizer chunks contribute their local optimizer (the state
of the parameters in this replica's partition), so the replicas together write every
parameter's state. A load asks only for the entries this process holds, whatever the dp
size or policy that wrote them: a checkpoint saved at one dp or tp size loads at another.

A save goes to a temporary directory; after every rank has written, rank 0 writes
COMPLETE.json into it and renames it into place, so a step directory with COMPLETE.json
is complete. The two newest steps are kept. The RNG state is not saved: the runs that use
these checkpoints draw no random numbers during training (batches are a function of seed
and step).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from .checkpoint import held_once, with_tied_copies
from .config import TrainConfig

__all__ = [
    "MARKER",
    "claim_sharded",
    "has_sharded",
    "latest_sharded_step",
    "load_sharded",
    "portable_meta",
    "read_marker",
    "save_sharded",
    "step_path",
]

MARKER = "COMPLETE.json"
_STEP = re.compile(r"^dcp-step(\d+)$")
_TEMPORARY = re.compile(r"^\.dcp-step(\d+)\.tmp$")
_KEEP = 2
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def step_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"dcp-step{step:08d}"


def portable_meta(meta: Mapping[str, object]) -> dict:
    """The run description a resume must match: the dp and tp sizes, the policies and m may
    change as long as the global batch (dp x m x microbatch) stays the same."""
    out = {k: v for k, v in meta.items() if k not in ("dp", "sharding", "m", "tp")}
    out["global_batch"] = int(meta.get("dp", 1)) * int(meta["m"]) * int(meta["microbatch_size"])
    return out


def _state(stages: Mapping[int, nn.Module], optimizers: Sequence[torch.optim.Optimizer]):
    """The module and the state dict DCP saves and loads: every stage's weights (a tied head's
    copy left out: the checkpoint holds the weight once) and the optimizers' state."""
    model = nn.ModuleDict({f"stage{s}": stages[s] for s in sorted(stages)})
    model_state, optim_state = get_state_dict(model, optimizers=list(optimizers), options=_OPTIONS)
    for s in sorted(stages):
        model_state = {**{k: v for k, v in model_state.items() if not k.startswith(f"stage{s}.")},
                       **held_once(stages[s], {k: v for k, v in model_state.items() if k.startswith(f"stage{s}.")},
                                   prefix=f"stage{s}.")}
    return model, {"model": model_state, "optim": optim_state}


def save_sharded(
    directory: str | os.PathLike,
    *,
    step: int,
    stages: Mapping[int, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    meta: Mapping[str, object],
) -> Path:
    """Save every rank's state after `step` completed steps (a collective); return the step directory."""
    directory = Path(directory)
    tmp, final = directory / f".dcp-step{step:08d}.tmp", step_path(directory, step)
    rank = dist.get_rank()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    _, state = _state(stages, optimizers)
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        record = {"step": step, "world_size": dist.get_world_size(), "meta": portable_meta(meta)}
        with open(tmp / MARKER, "w") as handle:
            handle.write(json.dumps(record, indent=1) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        if final.exists():
            # the marker goes first, so a half-removed old copy never reads as complete
            (final / MARKER).unlink(missing_ok=True)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in _complete_steps(directory)[:-_KEEP]:
            (step_path(directory, old) / MARKER).unlink(missing_ok=True)
            shutil.rmtree(step_path(directory, old), ignore_errors=True)
    dist.barrier()
    return final


def load_sharded(
    directory: str | os.PathLike,
    *,
    step: int,
    stages: Mapping[int, nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
) -> int:
    """Load step `step` into this rank's chunks and optimizers (a collective); return the step to run next."""
    path = step_path(directory, step)
    if not (path / MARKER).is_file():
        raise ValueError(
            f"{str(path)!r} is not a complete checkpoint (no {MARKER}): resume from latest_sharded_step"
        )
    model, state = _state(stages, optimizers)
    dcp.load(state, checkpoint_id=str(path))
    current = get_state_dict(model, optimizers=[], options=_OPTIONS)[0]
    for s in sorted(stages):  # the tied copies keep their values until the resume copies the embedding's
        state["model"] = with_tied_copies(stages[s], state["model"], current, prefix=f"stage{s}.")
    set_state_dict(model, optimizers=list(optimizers), model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_OPTIONS)
    return int(read_marker(directory, step)["step"])


def read_marker(directory: str | os.PathLike, step: int) -> dict:
    return json.loads((step_path(directory, step) / MARKER).read_text())


def _complete_steps(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        match = _STEP.match(entry.name)
        if match and (entry / MARKER).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_sharded_step(directory: str | os.PathLike) -> int | None:
    """The newest complete step in `directory`; None if there is none."""
    steps = _complete_steps(Path(directory))
    return steps[-1] if steps else None


def has_sharded(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds any step directory or temporary of this format."""
    directory = Path(directory)
    return directory.is_dir() and any(_STEP.match(e.name) or _TEMPORARY.match(e.name) for e in directory.iterdir())


def uses_sharded_checkpoints(cfg: TrainConfig) -> bool:
    """Whether the run's checkpoints go through torch.distributed.checkpoint: always with data
    or tensor parallelism or sharding, and when resuming such a checkpoint (at any dp or tp size)."""
    ck = cfg.checkpoint
    if ck is None:
        return False
    return cfg.data_parallel or cfg.tp > 1 or (ck.resume and has_sharded(ck.directory))


def claim_sharded(directory: str | os.PathLike, *, overwrite: bool, dry_run: bool = False) -> list[Path]:
    """As checkpoint.claim_directory, for step directories of this format; return those removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = sorted(e for e in directory.iterdir() if _STEP.match(e.name) or _TEMPORARY.match(e.name))
    kept = [e for e in found if _STEP.match(e.name)]
    if kept and not overwrite:
        steps = sorted(int(_STEP.match(e.name).group(1)) for e in kept)
        raise ValueError(
            f"--checkpoint {str(directory)!r} already holds data-parallel checkpoints of another run "
            f"(steps {steps}): add --resume to continue that run, --overwrite to replace them, "
            "or choose a new --checkpoint directory"
        )
    if not dry_run:
        for entry in found:
            (entry / MARKER).unlink(missing_ok=True)
            shutil.rmtree(entry, ignore_errors=True)
    return found
