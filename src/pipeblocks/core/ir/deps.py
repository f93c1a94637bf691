"""The dependencies of a pass, in terms of the phases of other (stage, microbatch, chunk) units.

A unit (s, i, c) goes through three phases: "F" (forward done), "B" (input gradient done:
by B or fused BW) and "W" (weight gradient done: by W or BW). With S stages and k
sequence chunks:

    F(s,i,c) after F(s-1,i,c) and, for c > 0, F(s,i,c-1)   (attention reads earlier K/V)
    B(s,i,c) after F(s,i,c); B(s+1,i,c) (or, on the last stage, the loss of F(S-1,i,c));
             and, for c < k-1, B(s,i,c+1)                  (K/V gradients flow back)
    W(s,i,c) after B(s,i,c)

With `chain_length` L (a schedule of several chains, `Schedule.chains`: DualPipe's two
directions), the stages are independent pipelines of L stages each: a stage that starts a
chain (s % L == 0) takes the step's input, one that ends it computes the loss.
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


def requirements(action: Action, num_stages: int, seq_chunks: int,
                 chain_length: int | None = None) -> tuple[Phase, ...]:
    """The phases that must be complete before `action` may start."""
    s, i, c = action.unit
    first = s % chain_length == 0 if chain_length else s == 0
    last = (s + 1) % chain_length == 0 if chain_length else s == num_stages - 1
    if action.kind is Kind.F:
        needs = [("F", s - 1, i, c)] if not first else []
        if c > 0:
            needs.append(("F", s, i, c - 1))
        return tuple(needs)
    if action.kind is Kind.W:
        return (("B", s, i, c),)
    needs = [("F", s, i, c)]
    if not last:
        needs.append(("B", s + 1, i, c))
    if c < seq_chunks - 1:
        needs.append(("B", s, i, c + 1))
    return tuple(needs)
