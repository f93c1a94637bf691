"""The dependencies of a pass, in terms of the phases of other (stage, microbatch, chunk) units.

A unit (s, i, c) goes through three phases: "F" (forward done), "B" (input gradient done:
by B or fused BW) and "W" (weight gradient done: by W or BW). With S stages and k
sequence chunks:

    F(s,i,c) after F(s-1,i,c) and, for c > 0, F(s,i,c-1)   (attention reads earlier K/V)
    B(s,i,c) after F(s,i,c); B(s+1,i,c) (or, on the last stage, the loss of F(S-1,i,c));
             and, for c < k-1, B(s,i,c+1)                  (K/V gradients flow back)
    W(s,i,c) after B(s,i,c)
"""
from __future__ import annotations

from .actions import Action, Kind

__all__ = ["Phase", "phase_of", "requirements"]

Phase = tuple[str, int, int, int]  # (phase, stage, microbatch, seq chunk)


def phase_of(action: Action) -> tuple[Phase, ...]:
    """The phases an action completes."""
    s, i, c = action.unit
    if action.kind is Kind.F:
        return (("F", s, i, c),)
    if action.kind is Kind.B:
        return (("B", s, i, c),)
    if action.kind is Kind.W:
        return (("W", s, i, c),)
    return (("B", s, i, c), ("W", s, i, c))


def requirements(action: Action, num_stages: int, seq_chunks: int) -> tuple[Phase, ...]:
    """The phases that must be complete before `action` may start."""
    s, i, c = action.unit
    if action.kind is Kind.F:
        needs = [("F", s - 1, i, c)] if s > 0 else []
        if c > 0:
            needs.append(("F", s, i, c - 1))
        return tuple(needs)
    if action.kind is Kind.W:
        return (("B", s, i, c),)
    needs = [("F", s, i, c)]
    if s < num_stages - 1:
        needs.append(("B", s + 1, i, c))
    if c < seq_chunks - 1:
        needs.append(("B", s, i, c + 1))
    return tuple(needs)
