"""`--split auto`: choose the transformer layers of every stage with the simulator.

The first stage holds the embedding and the last the head and its softmax cross entropy;
with a large vocabulary the head alone outweighs a few layers (Llama 3's 128k vocabulary
at hidden 4096: about two), so an even split makes the last stage the slowest and, under
1F1B, stage 0 the fullest. The choice minimises the simulated step among the splits whose
every rank fits the memory budget (static memory at the step's peak plus peak activation,
`Timeline.memory_need`), then the largest rank's memory.

The search is a descent over single-layer moves, started from the better of two splits:
the even rule (`core.cost.split.layer_counts`) and the split that balances the stages' pass
times (`balanced_counts`: each stage's F + B + W as a fixed part, the head's, plus its
layers at one layer's time, the largest made as small as it can be). Every round tries
each move of one layer from stage i to stage j (S*(S-1) splits at S stages) and takes the
best if it improves; it stops when none does. At p = 8, 1F1B, a few rounds of 56 cheap
simulations; on a V placement (16 stages) some 600, a few seconds.

Balancing stage by stage is not enough where a rank holds several stages: under zb-v or
v-half rank 0 holds stage 0 (the embedding) and the last stage (the head), so the split
must move layers off both of them and onto stages of other ranks, which the simulated
step sees and the per-stage balance does not:

    llama-3-8b on a100, flash attention, m = 32, p = 8 (simulated step, s)
    1f1b   even 4,4,4,4,4,4,4,4  9.00   balanced 5,5,4,4,4,4,4,2  7.34   auto 5,5,4,4,4,4,4,2  7.34
    zb-v   even 2 x 16           8.01   balanced 3,2,...,2,1      7.87   auto 1,2,...,3,3,2,2,1  6.56
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.ir.errors import ScheduleError
from ..core.cost.split import layer_counts, split_text

__all__ = ["SplitChoice", "balanced_counts", "choose_split"]

Score = Callable[[tuple[int, ...]], tuple[float, float]]
"""counts -> (simulated step, the largest rank's memory need)"""

_REL = 1e-9  # a step this much shorter (relative) counts as shorter: no cycling on rounding


@dataclass(frozen=True)
class SplitChoice:
    """What `--split auto` chose, and the even split it is measured against."""

    counts: tuple[int, ...]
    step: float
    """the chosen split's simulated step"""
    need: float
    """its largest per-rank memory need (static at the step's peak + peak activation)"""
    even: tuple[int, ...]
    even_step: float
    even_need: float
    evaluated: int
    """splits simulated"""

    def describe(self, unit: str = "") -> str:
        """One line for the commands: the choice beside the even split."""
        gain = 1.0 - self.step / self.even_step if self.even_step > 0 else 0.0
        return (f"split auto    {split_text(self.counts)} (step {self.step:.4g}{unit}, {gain:.1%} shorter than the even "
                f"{split_text(self.even)} at {self.even_step:.4g}{unit}; {self.evaluated} splits simulated)")


def balanced_counts(layers: int, per_layer: float, fixed: Sequence[float]) -> tuple[int, ...]:
    """Counts (each >= 1, summing to `layers`) that minimise the largest stage time
    fixed[s] + n_s * per_layer; ties leave the extra layers on the middle stages first.

    >>> balanced_counts(8, 1.0, (0.0, 0.0, 0.0, 2.0))
    (2, 3, 2, 1)
    """
    stages = len(fixed)
    if layers < stages or per_layer <= 0:
        return layer_counts(layers, stages)  # with too few layers, its error names the numbers

    def capacity(limit: float) -> list[int]:
        return [max(1, int((limit - fixed[s]) / per_layer + 1e-9)) for s in range(stages)]

    low, high = 0.0, max(fixed) + layers * per_layer
    for _ in range(100):  # bisection on the largest stage time
        mid = (low + high) / 2
        if sum(capacity(mid)) >= layers:
            high = mid
        else:
            low = mid
    counts = capacity(high)
    # the surplus comes off the slowest stage, one layer at a time (ties: the ends first)
    rank = {s: i for i, s in enumerate(reversed(list(range(1, stages - 1)) + [0, stages - 1][: min(2, stages)]))}
    for _ in range(sum(counts) - layers):
        stage = max((s for s in range(stages) if counts[s] > 1),
                    key=lambda s: (fixed[s] + counts[s] * per_layer, -rank[s]))
        counts[stage] -= 1
    return tuple(counts)


def choose_split(score: Score, *, layers: int, num_stages: int, budget: float | None = None,
                 starts: Sequence[tuple[int, ...]] = (), unit: float = 1.0, memory_unit: str = "") -> SplitChoice:
    """The split of `layers` over `num_stages` stages that `score` finds fastest within
    `budget` (per rank, in the score's memory units; None: no limit). `starts` are further
    splits to begin from (the even rule is always one); `unit` and `memory_unit` only shape
    the error when nothing fits."""
    seen: dict[tuple[int, ...], tuple[float, float]] = {}

    def key(counts: tuple[int, ...]) -> tuple[float, float, float]:
        if counts not in seen:
            seen[counts] = score(counts)
        step, need = seen[counts]
        over = max(0.0, need - budget) if budget is not None else 0.0
        return over, step, need

    def better(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
        (over_a, step_a, need_a), (over_b, step_b, need_b) = key(a), key(b)
        if over_a != over_b:
            return over_a < over_b
        if step_a < step_b * (1 - _REL):
            return True
        return step_a <= step_b * (1 + _REL) and need_a < need_b

    even = layer_counts(layers, num_stages)
    current = even
    for start in starts:
        if len(start) == num_stages and sum(start) == layers and min(start) >= 1 and better(tuple(start), current):
            current = tuple(start)
    while True:
        best = current
        for i in range(num_stages):
            if current[i] == 1:
                continue
            for j in range(num_stages):
                if j == i:
                    continue
                moved = list(current)
                moved[i] -= 1
                moved[j] += 1
                candidate = tuple(moved)
                if better(candidate, best):
                    best = candidate
        if best == current:
            break
        current = best
    over, step, need = key(current)
    if over > 0:
        raise ScheduleError(
            f"--split auto: no split fits --gpu-memory; the least found ({split_text(current)}) needs "
            f"{need / unit:.4g}{memory_unit} per rank (static memory at the step's peak + peak activation) against "
            f"{budget / unit:.4g}{memory_unit}: raise --gpu-memory, recompute (--recompute auto), shard (--dp, "
            "--sharding zero3) or use more pipeline ranks"
        )
    even_step, even_need = seen[even] if even in seen else score(even)
    return SplitChoice(current, step, need, even, even_step, even_need, len(seen))
