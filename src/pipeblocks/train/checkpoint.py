"""Per-rank checkpoints, verified before use, from which a run resumes exactly.

    DIR/rank0-step00000010.pt              rank 0's stages, optimizer, RNG and run description
    DIR/rank0-step00000010.manifest.json   its size and sha256, written last
    DIR/rank1-step00000010.pt ...          one pair per rank per saved step

    >>> save_rank(ckpt_dir, rank=0, step=10, stages={0: s0, 3: s3}, optimizer=opt, meta=meta)
    >>> step = latest_step(ckpt_dir, world_size=2)      # newest step intact on every rank
    >>> state = load_rank(ckpt_dir, rank=0, step=step)  # then restore_rank(state, stages, opt)

`step` counts completed optimizer steps: resuming from step 10 runs step 10 next. Data
needs no cursor (batches are a function of seed and step, see pipeblocks.data.text), and
the RNG state is restored for anything that draws from it.

Both files go to a temporary name in DIR and are renamed into place, the manifest after
the checkpoint, so a manifest that exists describes a complete file. A checkpoint counts
as intact only when its manifest parses and the file's size and sha256 match it; anything
else (a truncated or overwritten file, a lost manifest, a file from before manifests) is
damaged. `verify_rank` lists a rank's intact steps and its damaged files, and
`agree_step` picks the newest step intact on every rank, so all ranks resume from the
same step even when one rank's newest file is damaged.

Ranks save independently, so a crash can leave one rank a checkpoint ahead of another;
each rank keeps its two newest checkpoints. A new run refuses a directory that already
holds checkpoints (`claim_directory`): it must resume them, or be told to overwrite them.
Temporary files left by an interrupted write are removed by `remove_temporaries`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "RankCheck",
    "agree_step",
    "check_meta",
    "checkpoint_path",
    "claim_directory",
    "existing_files",
    "latest_step",
    "load_agreed",
    "load_rank",
    "manifest_path",
    "no_intact_message",
    "remove_temporaries",
    "restore_rank",
    "save_rank",
    "verify_rank",
    "warn_damaged",
]

_NAME = re.compile(r"^rank(\d+)-step(\d+)\.pt$")
_MANIFEST = re.compile(r"^rank(\d+)-step(\d+)\.manifest\.json$")
_TEMPORARY = re.compile(r"^\.rank(\d+)-step(\d+)\.(pt|manifest\.json)\..+$")
_KEEP = 2
_CHUNK = 1 << 20


def checkpoint_path(directory: str | os.PathLike, rank: int, step: int) -> Path:
    return Path(directory) / f"rank{rank}-step{step:08d}.pt"


def manifest_path(directory: str | os.PathLike, rank: int, step: int) -> Path:
    return Path(directory) / f"rank{rank}-step{step:08d}.manifest.json"


def save_rank(
    directory: str | os.PathLike,
    *,
    rank: int,
    step: int,
    stages: Mapping[int, nn.Module],
    optimizer: torch.optim.Optimizer,
    meta: Mapping[str, object],
    extra: Mapping[str, object] | None = None,
) -> Path:
    """Write this rank's state after `step` completed steps, then its manifest; prune its older files.

    `optimizer` is anything with `state_dict()` (one optimizer, or one per stage); `extra`:
    more state of the run, saved under "extra" (an asynchronous mode's, asynchronous/checkpoint.py)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "step": step,
        "rank": rank,
        "stages": {int(s): held_once(module, module.state_dict()) for s, module in stages.items()},
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "meta": dict(meta),
        **({"extra": dict(extra)} if extra else {}),
    }
    path = checkpoint_path(directory, rank, step)
    manifest = manifest_path(directory, rank, step)
    # a manifest left from an earlier save of this step must not vouch for the new file mid-write
    manifest.unlink(missing_ok=True)
    digest = hashlib.sha256()

    def write_state(handle) -> None:
        hashing = _HashingWriter(handle, digest)
        torch.save(state, hashing)
        if hashing.size == 0:
            raise OSError(f"torch.save wrote nothing to {str(path)!r}")

    size = _write_atomically(path, write_state)
    record = {"file": path.name, "rank": rank, "step": step, "bytes": size, "sha256": digest.hexdigest()}
    _write_atomically(manifest, lambda handle: handle.write(json.dumps(record, indent=1).encode() + b"\n"))
    for old in sorted(_steps_of(directory).get(rank, ()))[:-_KEEP]:
        # the manifest goes first: a half-pruned checkpoint then reads as damaged, never as intact
        manifest_path(directory, rank, old).unlink(missing_ok=True)
        checkpoint_path(directory, rank, old).unlink(missing_ok=True)
    return path


@dataclass(frozen=True)
class RankCheck:
    """One rank's checkpoints in a directory: the steps that verify, and what does not (path, why)."""

    rank: int
    intact: tuple[int, ...]
    damaged: tuple[tuple[str, str], ...]


def verify_rank(directory: str | os.PathLike, rank: int) -> RankCheck:
    """Check every checkpoint of `rank` in `directory` against its manifest (size, then sha256)."""
    directory = Path(directory)
    intact, damaged = [], []
    for step in sorted(_steps_of(directory).get(rank, ())):
        problem = _problem(directory, rank, step)
        if problem is None:
            intact.append(step)
        else:
            damaged.append((str(checkpoint_path(directory, rank, step)), problem))
    return RankCheck(rank, tuple(intact), tuple(damaged))


def agree_step(checks: Sequence[RankCheck]) -> int | None:
    """The newest step intact on every rank of `checks` (one per rank); None if there is none."""
    if not checks:
        return None
    common = set.intersection(*(set(c.intact) for c in checks))
    return max(common) if common else None


def latest_step(directory: str | os.PathLike, world_size: int) -> int | None:
    """The newest step intact for all `world_size` ranks (every file verified); None if there is none."""
    return agree_step([verify_rank(directory, r) for r in range(world_size)])


def no_intact_message(directory: str | os.PathLike, checks: Sequence[RankCheck]) -> str:
    """Why no step can be resumed, rank by rank, and what to do."""
    parts = []
    for c in checks:
        bad = "; ".join(f"{Path(p).name} ({why})" for p, why in c.damaged)
        parts.append(f"rank {c.rank} intact steps {list(c.intact)}" + (f", damaged {bad}" if bad else ""))
    return (
        f"no checkpoint in {str(directory)!r} is intact on all {len(checks)} ranks ({'; '.join(parts)}): "
        "drop --resume to start from step 0 (with --overwrite to replace these files), "
        "or resume from a directory with a complete checkpoint"
    )


def warn_damaged(check: RankCheck, step: int | None) -> None:
    """One line per damaged file of this rank, naming it and the step used instead."""
    for path, why in check.damaged:
        instead = f"resuming from step {step}" if step is not None else "no intact step to resume from"
        print(f"warning: checkpoint {path} is damaged ({why}): {instead}", file=sys.stderr, flush=True)


def load_rank(directory: str | os.PathLike, *, rank: int, step: int) -> dict:
    """The state of `rank` at `step`, verified against its manifest first."""
    path = checkpoint_path(directory, rank, step)
    problem = _problem(Path(directory), rank, step)
    if problem is not None:
        raise ValueError(
            f"checkpoint {str(path)!r} cannot be used ({problem}): resume from a step intact on every rank "
            "(latest_step / agree_step)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a file that verifies but does not load is still damaged
        raise ValueError(f"checkpoint {str(path)!r} matches its manifest but does not load: {err}") from None


def load_agreed(directory: str | os.PathLike, *, rank: int, world_size: int, meta: Mapping[str, object]) -> dict:
    """This rank's state at the newest step intact on every rank (a collective: the ranks
    exchange what they verified), checked against the run's `meta`; warns of damaged files."""
    import torch.distributed as dist

    mine = verify_rank(directory, rank)
    checks: list = [None] * world_size
    dist.all_gather_object(checks, mine)
    step = agree_step(checks)
    warn_damaged(mine, step)
    if step is None:
        raise ValueError(no_intact_message(directory, checks))
    state = load_rank(directory, rank=rank, step=step)
    check_meta(state["meta"], meta, directory)
    return state


def tied_copies(module: nn.Module) -> set[str]:
    """The names of the tied head weights `module` (a last stage) holds as a copy of the embedding's."""
    if not getattr(module, "is_last", False):
        return set()
    return {pair.last for pair in getattr(module, "tied", ())}


def held_once(module: nn.Module, state: Mapping[str, object], prefix: str = "") -> dict:
    """`state` (a stage's, keys under `prefix`) without the copies of a tied weight: a checkpoint
    holds the weight once, on the first stage; a resume copies it back (`runtime.tied`)."""
    copies = {prefix + name for name in tied_copies(module)}
    return {k: v for k, v in state.items() if k not in copies}


def with_tied_copies(module: nn.Module, saved: Mapping[str, object], current: Mapping[str, object],
                     prefix: str = "") -> dict:
    """`saved` with the tied copies it left out taken from `current` (the stage's own values, which
    the resume then replaces by the first stage's weight), so that every other key is still checked."""
    missing = {prefix + name for name in tied_copies(module)} - set(saved)
    return {**saved, **{k: current[k] for k in missing}}


def restore_rank(state: Mapping, stages: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer) -> int:
    """Load weights, optimizer state and RNG into this rank's objects; return the step to run next."""
    saved = state["stages"]
    if sorted(saved) != sorted(stages):
        raise ValueError(
            f"checkpoint holds stages {sorted(saved)} for rank {state['rank']} but this run gives it "
            f"{sorted(stages)}: resume with the schedule and -p the checkpoint was written with"
        )
    for s, module in stages.items():
        module.load_state_dict(with_tied_copies(module, saved[s], module.state_dict()))
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


def existing_files(directory: str | os.PathLike) -> list[Path]:
    """Every checkpoint, manifest and temporary file of this format in `directory` (nothing else)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    patterns = (_NAME, _MANIFEST, _TEMPORARY)
    return sorted(e for e in directory.iterdir() if any(p.match(e.name) for p in patterns))


def claim_directory(directory: str | os.PathLike, *, overwrite: bool, dry_run: bool = False) -> list[Path]:
    """Make `directory` ready for a new run (not a resume); return the files removed.

    Checkpoints already there belong to another run: without `overwrite` this raises
    ValueError naming them and the ways out; with it they are removed (only files of this
    format: other files in the directory are left alone). Temporary files of an
    interrupted save are removed either way. `dry_run`: check only, remove nothing.
    """
    found = existing_files(directory)
    # temporaries alone are debris of an interrupted save, not a run to protect
    kept = [f for f in found if not _TEMPORARY.match(f.name)]
    if not kept:
        if not dry_run:
            remove_temporaries(directory)
        return []
    if not overwrite:
        steps = sorted({int(m.group(2)) for f in kept if (m := _NAME.match(f.name))})
        raise ValueError(
            f"--checkpoint {str(directory)!r} already holds {len(kept)} checkpoint file(s) of another run "
            f"(steps {steps}): add --resume to continue that run, --overwrite to replace its checkpoints, "
            "or choose a new --checkpoint directory"
        )
    if not dry_run:
        for f in found:
            f.unlink(missing_ok=True)
    return found


def remove_temporaries(directory: str | os.PathLike, ranks: Iterable[int] | None = None) -> list[Path]:
    """Delete temporary files that an interrupted save of `ranks` (None: any rank) left; return them.

    Call only while no save to `directory` is under way for those ranks (at the start of a run).
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    wanted = None if ranks is None else set(ranks)
    removed = []
    for entry in sorted(directory.iterdir()):
        match = _TEMPORARY.match(entry.name)
        if match and (wanted is None or int(match.group(1)) in wanted):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


# ---- internals ----------------------------------------------------------------------------
class _HashingWriter:
    """A binary file wrapper that hashes and counts what passes through it."""

    def __init__(self, handle, digest) -> None:
        self._handle, self._digest, self.size = handle, digest, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        self.size += view.nbytes
        return self._handle.write(view)

    def flush(self) -> None:
        self._handle.flush()


def _write_atomically(path: Path, write) -> int:
    """Write through `write(handle)` to a temporary file beside `path`, fsync, rename; return the size."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
            size = handle.tell()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return size


def _problem(directory: Path, rank: int, step: int) -> str | None:
    """Why the checkpoint of (rank, step) is not intact, or None when it is."""
    path, manifest = checkpoint_path(directory, rank, step), manifest_path(directory, rank, step)
    if not path.is_file():
        return "file missing"
    try:
        record = json.loads(manifest.read_text())
        expected_size, expected_hash = int(record["bytes"]), str(record["sha256"])
    except FileNotFoundError:
        return "no manifest: an interrupted save, or written before checkpoints were verified"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable manifest: {err}"
    size = path.stat().st_size
    if size != expected_size:
        return f"{size} bytes, manifest says {expected_size}"
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != expected_hash:
        return "sha256 differs from the manifest"
    return None


def _steps_of(directory: Path) -> dict[int, list[int]]:
    """rank -> steps with a checkpoint file or a manifest (either marks a save that was started)."""
    found: dict[int, set[int]] = {}
    if not directory.is_dir():
        return {}
    for entry in directory.iterdir():
        match = _NAME.match(entry.name) or _MANIFEST.match(entry.name)
        if match:
            found.setdefault(int(match.group(1)), set()).add(int(match.group(2)))
    return {r: sorted(s) for r, s in found.items()}
