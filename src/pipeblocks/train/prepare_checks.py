"""The checks and resolutions `train.run.prepare` makes before any process starts: the
torchrun world, the device, the sequence chunks' lengths, the emulated links, and whether a
`--resume` can work. Each raises ValueError with the numbers and the fix; a tensor-parallel
group that would span nodes is only warned about.
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from ..resolve.request import ScheduleRequest
from ..sim.analytic import TransformerConfig, dp_link
from ..sim.hardware_profile import resolve_hardware
from ..sim.sequence_split import SPLITS, split_lengths
from .config import TrainConfig

if TYPE_CHECKING:
    from ..data import TokenWindows

__all__ = [
    "check_checkpoint_directory", "check_resume", "check_torchrun_world", "emulated_link", "progress", "run_device",
    "sequence_chunk_lengths", "tp_link", "warn_tp_across_nodes",
]


def check_torchrun_world(world: int, tp: int = 1) -> None:
    """Under torchrun, the processes it started must be the run's p x dp (x tp)."""
    from ..runtime.launch import under_torchrun  # torch: prepare and --dry-run's checks must not import it

    if under_torchrun() and int(os.environ["WORLD_SIZE"]) != world:
        started = int(os.environ["WORLD_SIZE"])
        shape, options = ("p x dp", "-p and --dp") if tp == 1 else ("p x dp x tp", "-p, --dp and --tp")
        raise ValueError(
            f"the run needs {shape} = {world} processes but torchrun started {started} (WORLD_SIZE): give torchrun "
            f"--nnodes x --nproc-per-node = {world}, or choose {options} whose product is {started}"
        )


def warn_tp_across_nodes(tp: int, device: str) -> None:
    """On CUDA under torchrun, say so when a tp group would span machines (its per-layer
    collectives would cross the slower link between them)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if tp == 1 or device != "cuda" or local is None:
        return
    if int(local) % tp:
        print(f"warning: --tp {tp} does not divide the {local} processes per node (LOCAL_WORLD_SIZE): tensor-parallel "
              "groups would span nodes, and their collectives (several per layer) cross the network; use a --tp "
              f"that divides {local}", file=sys.stderr, flush=True)


def run_device(requested: str, ranks: int, policy) -> str:
    """The device type for `ranks` processes (on this machine, or this node under torchrun),
    and a precision the device runs."""
    from ..runtime.launch import choose_device, under_torchrun  # torch, as above

    local = int(os.environ.get("LOCAL_WORLD_SIZE", ranks)) if under_torchrun() else ranks
    kind = choose_device(requested, local, note=progress)
    if kind == "cuda" and policy.compute == "bfloat16":
        import torch

        if not torch.cuda.is_bf16_supported():
            raise ValueError(f"--precision {policy.name}: this GPU ({torch.cuda.get_device_name()}) has no bfloat16: "
                             "use --precision fp32, or --device cpu")
    return kind


def sequence_chunk_lengths(schedule, split: str, model) -> tuple[int, ...] | None:
    """Tokens per sequence chunk (None without sequence chunks), balanced or even; `model`: the
    run's `model_choice.ModelChoice`."""
    k = schedule.seq_chunks
    if k == 1:
        return None
    if split not in SPLITS:
        raise ValueError(f"seq_split must be one of {', '.join(SPLITS)}, got {split!r}")
    seq = model.sequence
    if k > seq:
        raise ValueError(
            f"schedule {schedule.name!r} cuts every sequence into {k} chunks but sequences have "
            f"{seq} tokens: use --seq-chunks {seq} or fewer, or a longer --seq"
        )
    shape = model.shape
    analytic = TransformerConfig(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, seq=seq,
                                 vocab=shape.vocab)
    lengths = split_lengths(seq, k, split, analytic)
    if min(lengths) < 1:
        raise ValueError(f"the {split} split {list(lengths)} leaves an empty chunk: use fewer chunks")
    return tuple(lengths)


def emulated_link(request: ScheduleRequest) -> tuple[float, float]:
    """The DP link an emulated run's collectives take (bytes/s, s per ring step): --dp-bandwidth
    (GB/s) and --dp-latency (us), else the --hardware preset's link for d replicas."""
    spec = request.costs
    base = dp_link(resolve_hardware(spec.hardware), request.mesh.dp)
    bandwidth = base.bandwidth if spec.dp_bandwidth is None else spec.dp_bandwidth * 1e9
    latency = base.latency if spec.dp_latency is None else spec.dp_latency * 1e-6
    return bandwidth, latency


def tp_link(request: ScheduleRequest) -> tuple[float, float]:
    """The intra-node link an emulated run's tensor-parallel collectives take (bytes/s, s per
    ring step): the --hardware preset's or profile's."""
    hardware = resolve_hardware(request.costs.hardware)
    return hardware.intra_bandwidth, hardware.intra_latency


def check_checkpoint_directory(cfg: TrainConfig, data: TokenWindows) -> None:
    """A resume that cannot work, or a new run into another run's checkpoints, is refused now."""
    ck = cfg.checkpoint
    if ck is None:
        return
    if ck.resume:
        check_resume(cfg, data)
        return
    from . import checkpoint as ckpt  # torch (checkpoints are torch files): only with --checkpoint
    from . import sharded_checkpoint as sharded_ckpt

    ckpt.claim_directory(ck.directory, overwrite=ck.overwrite, dry_run=True)
    sharded_ckpt.claim_sharded(ck.directory, overwrite=ck.overwrite, dry_run=True)


def check_resume(cfg: TrainConfig, data: TokenWindows) -> None:
    from . import checkpoint as ckpt  # torch (checkpoints are torch files): only with --resume
    from .sharded_checkpoint import uses_sharded_checkpoints

    if uses_sharded_checkpoints(cfg):
        _check_sharded_resume(cfg, data)
        return
    # the ranks verify and agree again themselves (and warn about damaged files); this is
    # here so that a resume that cannot work fails before anything is launched
    directory = cfg.checkpoint.directory
    checks = [ckpt.verify_rank(directory, r) for r in range(cfg.schedule.p)]
    step = ckpt.agree_step(checks)
    if step is None:
        if not any(c.intact or c.damaged for c in checks):
            raise ValueError(
                f"--resume: no complete checkpoint for {cfg.schedule.p} ranks in {directory!r}: "
                "drop --resume to start from step 0"
            )
        raise ValueError(f"--resume: {ckpt.no_intact_message(directory, checks)}")
    ckpt.check_meta(ckpt.load_rank(directory, rank=0, step=step)["meta"], cfg.meta(data.source), directory)
    if step >= cfg.steps:
        raise ValueError(f"--resume: the checkpoint is at step {step} already: raise --steps above {step}")


def _check_sharded_resume(cfg: TrainConfig, data: TokenWindows) -> None:
    from . import checkpoint as ckpt  # torch (checkpoints are torch files): only with --resume
    from . import sharded_checkpoint as sharded_ckpt

    directory = cfg.checkpoint.directory
    step = sharded_ckpt.latest_sharded_step(directory)
    if step is None:
        raise ValueError(
            f"--resume: no complete data-parallel checkpoint (a dcp-step directory with "
            f"{sharded_ckpt.MARKER}) in {directory!r}: drop --resume to start from step 0"
        )
    saved = sharded_ckpt.read_marker(directory, step)["meta"]
    ckpt.check_meta(saved, sharded_ckpt.portable_meta(cfg.meta(data.source)), directory)
    if step >= cfg.steps:
        raise ValueError(f"--resume: the checkpoint is at step {step} already: raise --steps above {step}")


def progress(message: str) -> None:
    """A line about what is happening, on stderr: stdout keeps only the command's result."""
    print(message, file=sys.stderr, flush=True)
