"""Structural validation of a Schedule: placement, completeness, local order.

Cross-rank order is checked after lowering, by the deadlock check in `lower.py`;
`validate` runs both and returns the lowered Program. `check_program` checks a lowered
Program of its own (one built with extra passes, or read from text): its optimizer steps,
if it has any (`steps.py`), and freedom from deadlock.
"""
from __future__ import annotations

from itertools import chain
from operator import attrgetter

import numpy as np

from ..ir.actions import Action, Kind
from ..ir.deps import phase_of, requirements
from ..ir.errors import ScheduleError
from ..ir.schedule import Schedule
from .lower import PASSES, check_deadlock, lower
from .overlap import check_overlaps, fuse_overlaps
from .steps import check_optimizer_steps

__all__ = ["check_structure", "check_program", "validate"]

_STAGE, _KIND, _MICROBATCH, _SEQ_CHUNK = (attrgetter(f) for f in ("stage", "kind", "microbatch", "seq_chunk"))
_KIND_CODE = {Kind.F: 0, Kind.B: 1, Kind.W: 2, Kind.BW: 3}


def check_structure(schedule: Schedule) -> None:
    """Raise ScheduleError unless every pass runs exactly once, on its own rank, in local order."""
    _check_placement_and_ranges(schedule)
    _check_completeness(schedule)
    _check_local_order(schedule)
    if schedule.overlapped:
        check_overlaps(schedule)


def validate(schedule: Schedule):
    """Check structure, lower, and prove the Program free of deadlock. Returns the Program."""
    check_structure(schedule)
    program = lower(schedule, PASSES + ((fuse_overlaps,) if schedule.overlapped else ()))
    check_deadlock(program)
    return program


def check_program(program) -> None:
    """Raise ScheduleError unless the lowered `program` steps its optimizers where its
    microbatches' gradients are complete and runs without deadlock (its schedule is
    assumed to pass `check_structure`)."""
    check_optimizer_steps(program)
    check_deadlock(program)


def _check_placement_and_ranges(schedule: Schedule) -> None:
    S, m, k, chains = schedule.num_stages, schedule.m, schedule.seq_chunks, schedule.chains
    owner_of = schedule.placement.stage_to_rank
    for rank, actions in enumerate(schedule.ranks):
        for pos, action in enumerate(actions):
            stage, chunk = action.stage, action.seq_chunk
            if stage < S and owner_of[stage] == rank and action.microbatch < m and (
                (chunk is None or chunk == 0) if k == 1 else (chunk is not None and chunk < k)
            ) and (chains == 1 or stage * chains // S == action.microbatch * chains // m):
                continue
            where = f"rank {rank}, action {pos} ({action})"
            if stage >= S:
                raise ScheduleError(f"{where}: stage {stage} does not exist (stages 0..{S - 1})")
            if owner_of[stage] != rank:
                raise ScheduleError(
                    f"{where}: stage {stage} is placed on rank {owner_of[stage]}; "
                    f"move {action} to rank {owner_of[stage]}'s list"
                )
            if action.microbatch >= m:
                raise ScheduleError(f"{where}: microbatch {action.microbatch} is out of range for m={m} (0..{m - 1})")
            if chains > 1 and stage * chains // S != action.microbatch * chains // m:
                c = stage * chains // S
                raise ScheduleError(
                    f"{where}: stage {stage} is in chain {c} of {chains}, which runs microbatches "
                    f"{c * m // chains}..{(c + 1) * m // chains - 1}"
                )
            if k == 1:
                raise ScheduleError(f"{where}: sequence chunk {chunk} given but the schedule has seq_chunks=1")
            raise ScheduleError(f"{where}: needs a sequence chunk 0..{k - 1} (e.g. {stage}F0.0)")


def _check_completeness(schedule: Schedule) -> None:
    # fast path: count each (unit, kind) in an array over the units, where unit =
    # (stage * m + microbatch) * k + chunk (the ranges are checked): every F once, and per
    # unit either B and W once each or BW once, no pass twice
    S, m, k = schedule.num_stages, schedule.m, schedule.seq_chunks
    actions = list(chain.from_iterable(schedule.ranks))
    unit = np.fromiter(map(_STAGE, actions), np.int64, len(actions)) * m
    unit += np.fromiter(map(_MICROBATCH, actions), np.int64, len(actions))
    unit *= k
    if k > 1:
        unit += np.fromiter(map(_SEQ_CHUNK, actions), np.int64, len(actions))
    code = np.fromiter(map(_KIND_CODE.__getitem__, map(_KIND, actions)), np.int64, len(actions))
    counts = np.bincount(unit * 4 + code, minlength=4 * S * m * k).reshape(-1, 4)
    if schedule.chains > 1:  # a stage runs only its chain's microbatches
        chains = schedule.chains
        stage_chain = np.arange(S).repeat(m * k) * chains // S
        mb_chain = np.tile(np.arange(m).repeat(k), S) * chains // m
        counts = counts[stage_chain == mb_chain]
    f, b, w, bw = counts.T
    if (f == 1).all() and (b == w).all() and (b + bw == 1).all():
        return
    _diagnose_completeness(schedule)


def _diagnose_completeness(schedule: Schedule) -> None:
    """Walk every unit to name the first missing or repeated pass."""
    seen: set[tuple[int, int, int, Kind]] = set()
    for rank, actions in enumerate(schedule.ranks):
        for a in actions:
            key = (a.stage, a.microbatch, a.seq_chunk or 0, a.kind)
            if key in seen:
                raise ScheduleError(f"rank {rank}: {a} runs more than once; every pass runs exactly once")
            seen.add(key)
    k = schedule.seq_chunks
    F_, B_, W_, BW_ = Kind.F, Kind.B, Kind.W, Kind.BW
    for stage in range(schedule.num_stages):
        for mb in range(schedule.m):
            if schedule.chain_of_stage(stage) != schedule.chain_of_microbatch(mb):
                continue
            for chunk in range(k):
                has_f = (stage, mb, chunk, F_) in seen
                has_bw = (stage, mb, chunk, BW_) in seen
                has_b = (stage, mb, chunk, B_) in seen
                has_w = (stage, mb, chunk, W_) in seen
                if has_f and (has_bw != (has_b or has_w)) and has_b == has_w:
                    continue
                rank = schedule.placement.rank_of(stage)
                name = Action(stage, F_, mb, chunk if k > 1 else None)
                if not has_f:
                    raise ScheduleError(f"rank {rank}: missing {name}; add it to rank {rank}'s list")
                if has_bw and (has_b or has_w):
                    raise ScheduleError(
                        f"rank {rank}: unit {name} has both a fused {name.with_kind(BW_)} and split B/W passes; "
                        "use either BW or B then W"
                    )
                lacking = name.with_kind(B_ if has_w else W_ if has_b else BW_)
                raise ScheduleError(f"rank {rank}: missing {lacking}; add it to rank {rank}'s list")
    raise AssertionError("completeness fast path and diagnosis disagree")  # unreachable: a bug if hit


def _check_local_order(schedule: Schedule) -> None:
    S, m, k = schedule.num_stages, schedule.m, schedule.seq_chunks
    owner_of = schedule.placement.stage_to_rank
    # Completed phases, one byte per (phase, stage, microbatch, chunk), at
    # phase_base + (stage * m + microbatch) * k + chunk: an index, not a tuple in a set,
    # per action. One array serves every rank: a rank marks only its own stages' phases
    # and checks only needs on its own stages. Assumes the ranges were checked.
    units = S * m * k
    chain = schedule.chain_length
    phase_base = {"F": 0, "B": units, "W": 2 * units}
    done = bytearray(3 * units)
    # requirements() and phase_of() pass the microbatch through unchanged: resolve them once
    # per (kind, stage, chunk), keeping only the needs that live on the action's own rank,
    # as offsets to which microbatch * k is added
    templates: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for rank, actions in enumerate(schedule.ranks):
        for pos, action in enumerate(actions):
            key = (action.kind, action.stage, action.seq_chunk)
            template = templates.get(key)
            if template is None:
                probe = Action(action.stage, action.kind, 0, action.seq_chunk)
                template = templates[key] = (
                    tuple(phase_base[ph] + st * m * k + ch for ph, st, _, ch in requirements(probe, S, k, chain)
                          if owner_of[st] == rank),
                    tuple(phase_base[ph] + st * m * k + ch for ph, st, _, ch in phase_of(probe)),
                )
            offset = action.microbatch * k
            for base in template[0]:
                if not done[base + offset]:
                    need = next(n for n in requirements(action, S, k, chain) if phase_base[n[0]] + n[1] * m * k + n[3] == base)
                    later = _finisher(actions, need, pos)
                    raise ScheduleError(
                        f"rank {rank}, action {pos} ({action}) runs before {later}, which it depends on; "
                        f"move {action} after {later}"
                    )
            for base in template[1]:
                done[base + offset] = 1


def _finisher(actions: tuple[Action, ...], need: tuple, after: int) -> str:
    for action in actions[after:]:
        if need in phase_of(action):
            return str(action)
    phase, stage, mb, chunk = need
    return f"{stage}{phase}{mb}"
