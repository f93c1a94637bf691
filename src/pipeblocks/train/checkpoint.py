"""Per-rank checkpoints, written atomically, from which a run resumes exactly.

    DIR/rank0-step00000010.pt     rank 0's stages, optimizer, RNG and run description
    DIR/rank1-step00000010.pt     ...one file per rank per saved step

    >>> save_rank(ckpt_dir, rank=0, step=10, stages={0: s0, 3: s3}, optimizer=opt, meta=meta)
    >>> step = latest_step(ckpt_dir, world_size=2)      # newest step that every rank has
    >>> state = load_rank(ckpt_dir, rank=0, step=step)  # then restore_rank(state, stages, opt)

`step` counts completed optimizer steps: resuming from step 10 runs step 10 next. Data
needs no cursor (batches are a function of seed and step, see pipeblocks.data.text), and
the RNG state is restored for anything that draws from it.

Each file goes to a temporary name in DIR and is renamed into place, so a file that
exists is complete. Ranks save independently, so a crash can leave one rank a checkpoint
ahead of another; each rank keeps its two newest files, and `latest_step` picks the newest
step present for every rank.
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

__all__ = ["save_rank", "load_rank", "restore_rank", "latest_step", "checkpoint_path", "check_meta"]

_NAME = re.compile(r"^rank(\d+)-step(\d+)\.pt$")
_KEEP = 2


def checkpoint_path(directory: str | os.PathLike, rank: int, step: int) -> Path:
    return Path(directory) / f"rank{rank}-step{step:08d}.pt"


def save_rank(
    directory: str | os.PathLike,
    *,
    rank: int,
    step: int,
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer,
    meta: Mapping[str, object],
) -> Path:
    """Write this rank's state after `step` completed steps; prune its older files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "rank": rank,
        "stages": {int(s): module.state_dict() for s, module in stages.items()},
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "meta": dict(meta),
    }
    path = checkpoint_path(directory, rank, step)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in sorted(_steps_of(directory).get(rank, ()))[:-_KEEP]:
        checkpoint_path(directory, rank, old).unlink(missing_ok=True)
    return path


def latest_step(directory: str | os.PathLike, world_size: int) -> int | None:
    """The newest step for which all `world_size` ranks have a file; None if there is none."""
    found = _steps_of(Path(directory))
    if not found:
        return None
    common = set.intersection(*(set(found.get(r, ())) for r in range(world_size)))
    return max(common) if common else None


def load_rank(directory: str | os.PathLike, *, rank: int, step: int) -> dict:
    path = checkpoint_path(directory, rank, step)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {str(path)!r} is missing: resume from a directory every rank saved to") from None


def restore_rank(state: Mapping, stages: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer) -> int:
    """Load weights, optimizer state and RNG into this rank's objects; return the step to run next."""
    saved = state["stages"]
    if sorted(saved) != sorted(stages):
        raise ValueError(
            f"checkpoint holds stages {sorted(saved)} for rank {state['rank']} but this run gives it "
            f"{sorted(stages)}: resume with the schedule and -p the checkpoint was written with"
        )
    for s, module in stages.items():
        module.load_state_dict(saved[s])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def check_meta(saved: Mapping[str, object], current: Mapping[str, object], directory: str | os.PathLike) -> None:
    """Refuse to resume a run whose description (model, schedule, data, ...) differs."""
    keys = sorted(set(saved) | set(current))
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in keys if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise ValueError(
            f"checkpoint in {str(directory)!r} was written by a different run ({'; '.join(diffs)}): "
            "resume with the same options, or use a new --checkpoint directory"
        )


def _steps_of(directory: Path) -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    if not directory.is_dir():
        return found
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.setdefault(int(match.group(1)), []).append(int(match.group(2)))
    return found
