"""Sequence chunks of a step (Seq1F1B, `schedule.seq_chunks` = k > 1) as the runner makes them:
each microbatch's inputs and targets cut along dim 1 into k chunks, and the checks before.

    lengths = check_seq_lengths(schedule, (40, 24))        # None: an even split
    check_chunk_support(schedule, stages, compute=None)    # every stage's forward takes chunk=
    units = cut_sequences(xs, "inputs", schedule, lengths)  # m microbatches -> m*k units
    chunks = sequence_chunks(in_specs, m, k)                # (stage, microbatch, chunk) -> SequenceChunk
    check_target_chunks(ys, chunks, schedule, rank)

The chunk lengths are `seq_lengths` (default even, earlier chunks get the extra token); every
tensor of the inputs and targets is [batch, tokens, ...], and other tensors go as side inputs.
Each unit owns its storage (a clone), so what autograd saves of it is freed with the unit.
What a stage is told of its chunk, and the K/V cache across chunks: sequence.py.
"""
from __future__ import annotations

import inspect
from typing import Mapping, Sequence

import torch

from ..core.ir.schedule import Schedule
from .sequence import SequenceChunk, chunk_bounds
from .shapes import ActivationSpec, SpecMismatchError, flatten

__all__ = ["check_chunk_support", "check_seq_lengths", "check_target_chunks", "cut_sequences", "sequence_chunks"]


def check_seq_lengths(schedule: Schedule, lengths: Sequence[int] | None) -> tuple[int, ...] | None:
    """The runner's `seq_lengths`, checked against the schedule's k chunks (None: none given)."""
    k = schedule.seq_chunks
    if lengths is None:
        return None
    lengths = tuple(lengths)
    if k == 1:
        raise ValueError(
            f"seq_lengths {list(lengths)} given, but schedule {schedule.name!r} has no sequence chunks: drop "
            "seq_lengths or use a sequence-chunk schedule (seq1f1b, split_sequence(...))"
        )
    if len(lengths) != k or any(not isinstance(n, int) or isinstance(n, bool) for n in lengths):
        raise ValueError(
            f"seq_lengths {list(lengths)} must be {k} integers, one per sequence chunk of schedule {schedule.name!r}"
        )
    if min(lengths) < 1:
        raise ValueError(
            f"seq_lengths {list(lengths)} leave an empty chunk: every one of the {k} chunks needs at least one "
            "token; use fewer chunks or move tokens into the empty one"
        )
    return lengths


def check_chunk_support(schedule: Schedule, stages: Mapping[int, torch.nn.Module], compute: object | None) -> None:
    """Every stage must take `chunk=` (attend over earlier chunks' K/V); checked before any step."""
    for stage, module in sorted(stages.items()):
        if not getattr(module, "supports_sequence_chunks", True):
            raise ValueError(
                f"schedule {schedule.name!r} cuts sequences into {schedule.seq_chunks} chunks, but stage {stage} "
                f"({type(module).__name__}) says it cannot run sequence chunks (supports_sequence_chunks is False): "
                "use a schedule without sequence chunks (drop --seq-chunks)"
            )
        if not _takes_chunk(module.forward):
            raise ValueError(
                f"schedule {schedule.name!r} cuts sequences into {schedule.seq_chunks} chunks, but stage {stage} "
                f"({type(module).__name__}) cannot take sequence chunks: its forward has no `chunk` keyword. A "
                "stage run by chunks must attend over the K/V of earlier chunks (causal attention with "
                "`chunk.kv(layer).extend(k, v)`, as pipeblocks.models.GPTStage does); use such a model or a "
                "schedule without sequence chunks"
            )
    if compute is not None and not _takes_chunk(compute.forward):
        raise ValueError(
            f"schedule {schedule.name!r} cuts sequences into {schedule.seq_chunks} chunks, but the compute object "
            f"{type(compute).__name__} takes no `chunk`: run it with real modules or a schedule without sequence chunks"
        )


def _takes_chunk(fn) -> bool:
    try:
        return "chunk" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def cut_sequences(parts: list, name: str, schedule: Schedule, lengths: tuple[int, ...] | None) -> list:
    """m microbatches -> m*k units (microbatch-major), every tensor cut along dim 1 into the
    chunks of `lengths` (None: an even split)."""
    k = schedule.seq_chunks
    if k == 1:
        return parts
    first = flatten(parts[0], name)[1][0]
    seq = first.shape[1] if first.dim() >= 2 else 0
    if seq < k:
        raise ValueError(
            f"{name} have {seq} tokens per sequence (dim 1 of {tuple(first.shape)}) but schedule "
            f"{schedule.name!r} cuts every sequence into {k} chunks: use at most {seq} chunks "
            "(--seq-chunks) or longer sequences"
        )
    lengths = lengths or _even(seq, k)
    if sum(lengths) != seq:
        raise ValueError(
            f"seq_lengths {list(lengths)} sum to {sum(lengths)} tokens but the {name} have {seq} per sequence: "
            f"give chunk lengths that sum to {seq}"
        )
    units = []
    for part in parts:
        layout, leaves = flatten(part, name)
        for leaf in leaves:
            if leaf.dim() < 2 or leaf.shape[1] != seq:
                raise ValueError(
                    f"{name} hold a tensor of shape {tuple(leaf.shape)} beside one of {seq} tokens (dim 1): "
                    "with sequence chunks every tensor of the inputs and targets is [batch, tokens, ...]; "
                    "pass other tensors as side inputs"
                )
        # clones: each unit owns its storage, so what autograd saves of it is freed with the unit
        units += [layout.build([leaf[:, a:a + n].clone() for leaf in leaves]) for a, n in chunk_bounds(lengths)]
    return units


def _even(seq: int, k: int) -> tuple[int, ...]:
    base, extra = divmod(seq, k)
    return tuple(base + (1 if i < extra else 0) for i in range(k))


def sequence_chunks(in_specs: Mapping[int, list[ActivationSpec]], m: int,
                    k: int) -> dict[tuple[int, int, int], SequenceChunk]:
    """Every unit's SequenceChunk, from the lengths of its stage input (dim 1 of its first leaf)."""
    out = {}
    for stage, specs in in_specs.items():
        for mb in range(m):
            units = [spec.leaves[0] for spec in specs[mb * k:(mb + 1) * k]]
            if any(len(spec.shape) < 2 for spec in units):
                raise SpecMismatchError(
                    f"stage {stage} takes {units[0]} for microbatch {mb}; with sequence chunks stage inputs must "
                    "be [batch, tokens, ...], cut along dim 1"
                )
            lengths = [spec.shape[1] for spec in units]
            for c, (offset, n) in enumerate(chunk_bounds(lengths)):
                out[(stage, mb, c)] = SequenceChunk(stage, mb, c, k, offset, n, sum(lengths))
    return out


def check_target_chunks(ys: list[torch.Tensor], chunks: Mapping[tuple[int, int, int], SequenceChunk],
                        schedule: Schedule, rank: int) -> None:
    """Every target chunk as long as the chunk the last stage receives (rank: this rank, for the message)."""
    last = schedule.num_stages - 1
    k = schedule.seq_chunks
    for mb in range(schedule.m):
        for c in range(k):
            chunk = chunks[(last, mb, c)]
            length = flatten(ys[mb * k + c])[1][0].shape[1]
            if length != chunk.length:
                raise ValueError(
                    f"rank {rank}: targets of microbatch {mb}, chunk {c} have {length} "
                    f"tokens but the last stage receives {chunk.length}: give every rank the same seq_lengths"
                )
