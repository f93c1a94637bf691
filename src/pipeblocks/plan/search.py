"""The planner's search: every mesh x schedule x microbatch size x sharding policy, scored
by the simulator.

Per schedule (and sequence chunk count), a branch and bound:

1. every (mesh, microbatch size) is priced without building anything: its static memory
   (parameters, gradients, optimizer state at the step's peak: `estimate_memory`'s, as
   FSDP2 and ZeroRedundancyOptimizer hold them) and an MFU bound (model FLOPs over the
   busiest rank's compute alone). A mesh whose static memory exceeds the GPU under every policy is dropped;
2. meshes are visited by their best bound, microbatch sizes ascending; a candidate whose
   bound is below the best MFU the schedule already reached is not simulated, and the
   first size that does not fit ends its mesh (a larger microbatch holds more activation
   at every schedule's peak);
3. a candidate's schedule is generated once and simulated under the least-sharded policy
   whose static memory fits; its peak activation, which the DP ops do not change, tells
   which other policies fit, and only those are simulated again for their time;
4. a step of more than EXTRAPOLATE_FROM[1] * pp microbatches is simulated at the two
   counts of EXTRAPOLATE_FROM (times pp) and timed on their line (`PlanProblem.extrapolate`).

All DP replicas run the same program on equal shards, so one replica is simulated.
Schedules are searched in worker processes when `jobs` > 1.

Sequence chunks (Seq1F1B, Sun et al. 2024) cut each microbatch's activation in flight at
the price of smaller GEMMs and more hops. Unless `PlanProblem.seq_chunks` names the counts,
the search adds AUTO_SEQ_CHUNKS itself in a second round after whole sequences: always for
a sequence of LONG_SEQUENCE tokens or more, where a chunked candidate is simulated only if
its bound can beat the best whole-sequence plan (so a chunked schedule is listed only where
it may win), and for shorter sequences only when no configuration fits whole, so their
searches cost what they did.

MFU counts model FLOPs only (a recomputed forward is not useful work), over the
iteration time on all GPUs at the profile's peak: `sim.analytic.sequence_flops` per
sequence, L*(6*s*W_l + 12*s^2*(a*d)) + 6*s*h*V with W_l the elements of a block's matrices,
for the GPT 72*s*h^2*L*(1 + s/(6h) + V/(12*h*L)), as Megatron-LM and the papers count.
"""
from __future__ import annotations

import functools
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..core.ir.errors import ScheduleError
from ..core.ir.placement import Placement
from ..core.ir.sharding import ShardingPolicy
from ..resolve.program import simulate_run
from ..core.cost.vocab_partition import partition_vocab
from ..schedules import get
from ..schedules.sequence import split_sequence
from ..sim.analytic import sequence_flops
from ..sim.memory_estimate import rank_static_peak
from ..sim.sequence_split import with_chunk_shares
from ..sim.vocab_memory import vocab_rank_static_peak
from .costs import replica_costs
from .space import SHARDING_ORDER, MeshShape, PlanProblem, meshes, microbatch_sizes
from .vocab import vocab_replica_costs

__all__ = [
    "Candidate", "Evaluated", "Skipped", "PlanResult", "search", "search_schedule", "model_flops", "evaluate",
    "seq_chunk_rounds", "static_peak", "AUTO_SEQ_CHUNKS", "LONG_SEQUENCE",
]


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    schedule: str
    dp: int
    tp: int
    pp: int
    microbatch_size: int
    m: int
    seq_chunks: int = 1
    vocab_parallel: bool = False
    """the embedding and the head split by vocabulary over the pp ranks (`plan.vocab`)"""

    @property
    def label(self) -> str:
        return _label(self.schedule, self.seq_chunks, self.vocab_parallel)


def _label(schedule: str, seq_chunks: int, vocab: bool) -> str:
    return schedule + (f"+seq{seq_chunks}" if seq_chunks > 1 else "") + ("+vocab" if vocab else "")


@dataclass(frozen=True)
class Evaluated:
    """A simulated candidate. Memory in bytes per GPU (the worst rank), times in seconds."""

    candidate: Candidate
    sharding: str
    iteration_time: float
    mfu: float
    tokens_per_s: float
    peak_memory: float
    static_memory: float
    activation_memory: float
    bubble: float
    exposed_comm: float
    fits: bool
    simulated_m: tuple[int, ...] = ()
    """the microbatch counts simulated: (m,), or two counts whose line gives m's time"""
    rank_memory: tuple[tuple[float, float], ...] = ()
    """(static, peak activation) bytes per pipeline rank, the static of its worst replica:
    `sim.memory_estimate.estimate_memory`'s per-rank figures (tests/test_plan_memory.py)"""


@dataclass(frozen=True)
class Skipped:
    """A group or candidate left out before simulation, and why."""

    schedule: str
    shape: MeshShape
    microbatch_size: int | None
    reason: str
    least_memory: float | None = None
    """bytes per GPU it would need at least (static memory alone), when memory was the reason"""


@dataclass(frozen=True)
class PlanResult:
    problem: PlanProblem
    evaluated: tuple[Evaluated, ...]
    skipped: tuple[Skipped, ...]
    seconds: float
    simulations: int
    pruned: int = 0
    """candidates not simulated because their MFU bound was below their schedule's best"""
    seq_chunks: tuple[int, ...] = (1,)
    """the sequence chunk counts searched (1: whole sequences)"""

    @property
    def ranked(self) -> list[Evaluated]:
        """Feasible candidates, highest MFU first (ties: less memory)."""
        return sorted((e for e in self.evaluated if e.fits), key=_rank_key)

    @property
    def best_per_schedule(self) -> dict[str, Evaluated]:
        best: dict[str, Evaluated] = {}
        for e in self.ranked:
            best.setdefault(e.candidate.label, e)
        return best

    def least_memory_needed(self) -> float | None:
        """The smallest per-GPU memory any candidate was found to need (its simulated peak,
        or static memory alone when that was already over the GPU): a lower bound on the
        memory that would make one fit."""
        needs = [e.peak_memory for e in self.evaluated] + [
            s.least_memory for s in self.skipped if s.least_memory is not None
        ]
        return min(needs, default=None)


# Above EXTRAPOLATE_FROM[1] * pp microbatches the step is simulated at these multiples of
# pp and its time taken on their line: past the warm-up every schedule here repeats a
# steady-state block whose length does not depend on m, so time grows linearly in m and
# the activation peak is reached (tests/test_plan.py checks the line against a full simulation)
EXTRAPOLATE_FROM = (2, 4)

# Sequence chunk counts tried without being asked, and the sequence length from which they
# are tried from the start (below it only when nothing fits without them): at 8192 tokens a
# layer's activation per sequence is several times its share of the parameters' state
AUTO_SEQ_CHUNKS = (2, 4)
LONG_SEQUENCE = 8192

# Local-search steps for the cost-aware generators: their default (100) roughly doubles a
# deep pipeline's build time; on the Table 3 grid 10 steps build the same schedules
LOCAL_SEARCH = 10


def _rank_key(e: Evaluated) -> tuple:
    c = e.candidate
    return (-e.mfu, e.peak_memory, c.schedule, c.seq_chunks, c.vocab_parallel, c.dp, c.tp, c.pp, c.microbatch_size,
            e.sharding)


def model_flops(problem: PlanProblem) -> float:
    """Model FLOPs of one step (forward and backward of the global batch)."""
    return problem.global_batch * sequence_flops(problem.model)


def _placement(name: str, pp: int, stages: int) -> Placement:
    return Placement.v_shape(pp) if get(name).v == 2 else Placement.loop(pp, stages // pp)


def static_peak(problem: PlanProblem, shape: MeshShape, placement: Placement,
                policy: ShardingPolicy, name: str, vocab: bool = False) -> tuple[float, ...]:
    """Static bytes per pipeline rank at the step's peak (the most over the replicas):
    `estimate_memory`'s static part, through `sim.memory_estimate.rank_static_peak`; with
    `vocab`, the stages without the vocabulary tables and each rank's rows of them
    (`sim.vocab_costs.vocab_rank_static_peak`)."""
    if vocab:
        return tuple(
            vocab_rank_static_peak(problem.staged(problem.model, placement.num_stages, True), placement.num_stages,
                                   placement.stages_of(r), policy, dp=shape.dp,
                                   precision=problem.precision, ranks=shape.pp,
                                   split_backward=split_backward(name))
            for r in range(placement.num_ranks)
        )
    return tuple(
        rank_static_peak(problem.staged(problem.model, placement.num_stages), placement.num_stages,
                         placement.stages_of(r), (policy,), dp=shape.dp,
                         precision=problem.precision, tp=shape.tp, split_backward=split_backward(name))
        for r in range(placement.num_ranks)
    )


@functools.cache
def split_backward(name: str) -> bool:
    """Whether schedule `name` runs W apart from B (a small instance tells; one that cannot be
    built without options counts as split, the larger static memory)."""
    try:
        return get(name)(p=2, m=4).has_split_backward
    except (TypeError, ValueError):
        return True


def _policies(shape: MeshShape) -> list[ShardingPolicy]:
    if shape.dp > 1 and shape.tp > 1:  # the runtime shards tensor-parallel stages over dp with FSDP2 only
        return [pol for pol in SHARDING_ORDER if pol in (ShardingPolicy.ZERO2, ShardingPolicy.ZERO3)]
    return [pol for pol in SHARDING_ORDER if shape.dp > 1 or pol is ShardingPolicy.REPLICATE]


def _generate(name: str, pp: int, m: int, k: int, costs):
    spec = get(name)
    kwargs: dict[str, object] = {"p": pp, "m": m}
    if spec.accepts("costs"):
        kwargs["costs"] = costs
    if spec.accepts("search"):
        kwargs["search"] = LOCAL_SEARCH
    if k > 1:
        return split_sequence(name, seq_chunks=k, **kwargs)
    return spec(**kwargs)


@dataclass(frozen=True)
class _Entry:
    """One (mesh, microbatch size) of a schedule, priced before anything is built."""

    bound: float
    """MFU upper bound: model FLOPs over the busiest rank's compute alone"""
    shape: MeshShape
    microbatch_size: int
    m: int
    stages: int


def _entries(problem: PlanProblem, name: str, k: int, vocab: bool = False) -> tuple[list[_Entry], list[Skipped]]:
    """The schedule's candidates that pass the static-memory check, with their bounds."""
    entries, skipped = [], []
    label = _label(name, k, vocab)
    spec = get(name)
    flops, peak_rate = model_flops(problem), problem.hardware.flops * problem.gpus
    for shape in meshes(problem):
        if vocab and (shape.tp > 1 or shape.pp < 2):
            skipped.append(Skipped(label, shape, None, "vocabulary parallelism splits the vocabulary over 2 or more "
                                                       "pipeline ranks, without tensor parallelism"))
            continue
        if vocab:
            try:
                partition_vocab(problem.model.vocab, shape.pp)
            except ValueError as err:
                skipped.append(Skipped(label, shape, None, str(err)))
                continue
        if shape.tp > 1 and k > 1:
            skipped.append(Skipped(label, shape, None, "sequence chunks with tp > 1: the runtime runs neither with "
                                                       "the other (tp already splits the tokens)"))
            continue
        for b in microbatch_sizes(problem, shape):
            m = problem.global_batch // (shape.dp * b)
            stages = spec.num_stages(p=shape.pp, m=m)
            if stages > problem.model.layers:
                skipped.append(Skipped(label, shape, None, f"{stages} stages for {problem.model.layers} layers"))
                break  # the stage count does not depend on b
            try:
                problem.stage_split(stages)
            except ValueError as err:  # --split's counts are for another stage count
                skipped.append(Skipped(label, shape, None, str(err).split(":")[0]))
                break
            placement = _placement(name, shape.pp, stages)
            least, least_policy = min(
                (max(static_peak(problem, shape, placement, pol, name, vocab)), pol) for pol in _policies(shape)
            )
            costs = _costs(problem, shape, b, stages, k, least_policy, vocab)
            if least > problem.gpu_memory:
                skipped.append(Skipped(
                    label, shape, None,
                    f"static memory {least / 1e9:.1f} GB per GPU even under {least_policy} > "
                    f"{problem.gpu_memory / 1e9:.4g} GB",
                    least_memory=least,
                ))
                break  # static memory does not depend on the microbatch size
            table = costs.resolve(placement, k)
            shared = 0.0 if costs.vocab is None else sum(costs.vocab.duration(kind) for kind in ("IF", "S", "T", "IB"))
            busy = max(
                m * (shared + sum(table.f[s] + table.b[s] + table.w[s] for s in placement.stages_of(r)))
                for r in range(shape.pp)
            )
            entries.append(_Entry(flops / (busy * peak_rate), shape, b, m, stages))
    return entries, skipped


def _costs(problem: PlanProblem, shape: MeshShape, b: int, stages: int, k: int, policy: ShardingPolicy,
           vocab: bool = False):
    config = problem.staged(problem.config(b), stages, vocab)
    if vocab:  # tp = 1 and whole sequences (`_entries`)
        return vocab_replica_costs(
            config, problem.hardware, num_stages=stages, ranks=shape.pp, dp=shape.dp, sharding=policy,
            precision=problem.precision, intensity=problem.intensity, w_keeps=problem.w_keeps,
            dp_unit=problem.dp_unit,
        )
    costs = replica_costs(
        config, problem.hardware, num_stages=stages, dp=shape.dp, tp=shape.tp, sharding=policy,
        precision=problem.precision, intensity=problem.intensity, seq_chunks=k, w_keeps=problem.w_keeps,
        dp_unit=problem.dp_unit,
    )
    return with_chunk_shares(costs, config, k)


def evaluate(
    problem: PlanProblem, name: str, k: int, entry: _Entry, *, shardings: Iterable[ShardingPolicy] | None = None,
    vocab: bool = False,
) -> tuple[list[Evaluated], list[Skipped], int]:
    """Simulate one candidate under each sharding policy that can fit (of `shardings`, or
    of every policy the mesh allows): the best that fits (or, when none does, the least
    memory one), what was left out, and the simulations run."""
    shape, b, m = entry.shape, entry.microbatch_size, entry.m
    label = _label(name, k, vocab)
    capacity = problem.gpu_memory
    flops, peak_rate = model_flops(problem), problem.hardware.flops * problem.gpus
    tokens = problem.global_batch * problem.model.seq
    placement = _placement(name, shape.pp, entry.stages)
    policies = _policies(shape)
    if shardings is not None:
        wanted = {ShardingPolicy(pol) for pol in shardings}
        policies = [pol for pol in policies if pol in wanted]
        if not policies:
            raise ValueError(f"no sharding policy of {sorted(map(str, wanted))} applies to dp {shape.dp}: "
                             "with one replica only replicate does")
    costs = {pol: _costs(problem, shape, b, entry.stages, k, pol, vocab) for pol in policies}
    static = {pol: static_peak(problem, shape, placement, pol, name, vocab) for pol in policies}
    fitting = [pol for pol in policies if max(static[pol]) <= capacity]
    if not fitting:
        least = min(max(static[pol]) for pol in policies)
        return [], [Skipped(label, shape, b, f"static memory {least / 1e9:.1f} GB per GPU > {capacity / 1e9:.4g} GB",
                            least_memory=least)], 0
    candidate = Candidate(name, shape.dp, shape.tp, shape.pp, b, m, k, vocab)
    simulated = (m,)
    if problem.extrapolate and m > EXTRAPOLATE_FROM[1] * shape.pp:
        simulated = tuple(f * shape.pp for f in EXTRAPOLATE_FROM)
        try:
            schedules = [_generate(name, shape.pp, mi, k, costs[fitting[0]]) for mi in simulated]
        except (ScheduleError, ValueError):
            simulated = (m,)
    if simulated == (m,):
        try:
            schedules = [_generate(name, shape.pp, m, k, costs[fitting[0]])]
        except (ScheduleError, ValueError) as err:
            return [], [Skipped(label, shape, b, f"not built: {err}")], 0
    results: list[Evaluated] = []
    activation = None
    runs = 0
    for pol in fitting:
        if activation is not None and max(s + a for s, a in zip(static[pol], activation)) > capacity:
            continue
        try:
            timelines = [simulate_run(schedule, costs[pol]) for schedule in schedules]
        except ScheduleError as err:
            if not vocab:
                raise
            # the vocabulary passes could not be placed into this schedule: the plain candidate stands
            return [], [Skipped(label, shape, b, f"not built: {err}")], runs
        runs += len(timelines)
        activation = tuple(map(max, *(t.peak_activation for t in timelines))) if len(timelines) > 1 else (
            timelines[0].peak_activation)
        need = max(s + a for s, a in zip(static[pol], activation))
        span = _at(m, simulated, [t.makespan for t in timelines])
        busy = _at(m, simulated, [max(t.busy(r) for r in range(shape.pp)) for t in timelines])
        last = timelines[-1]
        results.append(Evaluated(
            candidate=candidate, sharding=str(pol), iteration_time=span,
            mfu=flops / (span * peak_rate), tokens_per_s=tokens / span, peak_memory=need,
            static_memory=max(static[pol]), activation_memory=max(activation),
            bubble=(span - busy) / span if span > 0 else 0.0, exposed_comm=max(last.exposed_comm, default=0.0),
            fits=need <= capacity, simulated_m=simulated, rank_memory=tuple(zip(static[pol], activation)),
        ))
    feasible = [r for r in results if r.fits]
    if feasible:
        return [min(feasible, key=lambda r: (r.iteration_time, r.peak_memory))], [], runs
    return [min(results, key=lambda r: r.peak_memory)], [], runs


def _at(m: int, simulated: tuple[int, ...], values: list[float]) -> float:
    """The value at m: simulated there, or on the line through the two simulated counts."""
    if len(simulated) == 1:
        return values[0]
    (m1, m2), (v1, v2) = simulated, values
    return v2 + (m - m2) * (v2 - v1) / (m2 - m1)


def search_schedule(
    problem: PlanProblem, name: str, k: int = 1, *, exhaustive: bool = False, floor: float = 0.0,
    vocab: bool = False,
) -> tuple[list[Evaluated], list[Skipped], int, int]:
    """Branch and bound over one schedule's candidates, meshes with the highest MFU bound
    first: a candidate whose bound is below the best MFU that fits, or below `floor`, is
    not simulated (unless `exhaustive`). A mesh whose
    microbatch size b does not fit is not tried at larger b (more activation at the peak).
    `vocab`: the schedule with vocabulary parallelism (`plan.vocab`).
    Returns the evaluated, the skipped, the simulations run and the candidates pruned."""
    entries, skipped = _entries(problem, name, k, vocab)
    # meshes by their best bound; within a mesh the sizes ascend, so the first size that
    # does not fit ends the mesh
    top: dict[MeshShape, float] = {}
    for e in entries:
        top[e.shape] = max(top.get(e.shape, 0.0), e.bound)
    entries.sort(key=lambda e: (-top[e.shape], e.shape, e.microbatch_size))
    evaluated: list[Evaluated] = []
    runs = pruned = 0
    best = floor
    too_big: dict[MeshShape, int] = {}
    for entry in entries:
        if entry.microbatch_size > too_big.get(entry.shape, entry.microbatch_size):
            continue
        if not exhaustive and entry.bound < best:
            pruned += 1
            continue
        done, left, sims = evaluate(problem, name, k, entry, vocab=vocab)
        evaluated += done
        skipped += left
        runs += sims
        for e in done:
            if e.fits:
                best = max(best, e.mfu)
            else:
                too_big[entry.shape] = min(too_big.get(entry.shape, entry.microbatch_size), entry.microbatch_size)
    return evaluated, skipped, runs, pruned


def seq_chunk_rounds(problem: PlanProblem) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """The chunk counts searched first; those searched in a second round; and whether the
    second round always runs (a long sequence) or only when nothing fitted in the first."""
    if problem.seq_chunks is not None:
        return (1, *sorted(set(problem.seq_chunks) - {1})), (), False
    auto = tuple(k for k in AUTO_SEQ_CHUNKS if k <= problem.model.seq)
    return (1,), auto, problem.model.seq >= LONG_SEQUENCE


def _run_task(problem: PlanProblem, exhaustive: bool, floor: float, tasks, index: int):
    name, k, vocab = tasks[index]
    return index, search_schedule(problem, name, k, exhaustive=exhaustive, floor=floor, vocab=vocab)


def _run_tasks(
    problem: PlanProblem, tasks: list[tuple[str, int, bool]], jobs: int | None, exhaustive: bool,
    progress: Callable[[str], None] | None, start: float, floor: float = 0.0,
) -> list[tuple]:
    """search_schedule of every (schedule, chunk count, vocabulary parallelism), in task order."""
    workers = min(jobs if jobs is not None else min(2, os.cpu_count() or 1), len(tasks))
    run = functools.partial(_run_task, problem, exhaustive, floor, tasks)
    outcomes: Iterable
    pool = None
    if workers > 1:
        methods = multiprocessing.get_all_start_methods()
        pool = multiprocessing.get_context("fork" if "fork" in methods else "spawn").Pool(workers)
        outcomes = pool.imap_unordered(run, range(len(tasks)))
    else:
        outcomes = map(run, range(len(tasks)))
    collected: dict[int, tuple] = {}
    try:
        for done, (index, outcome) in enumerate(outcomes, 1):
            collected[index] = outcome
            if progress is not None:
                label = _label(*tasks[index])
                progress(f"plan: {done}/{len(tasks)} {label}: {outcome[2]} simulations, "
                         f"{time.perf_counter() - start:.1f} s")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return [collected[index] for index in range(len(tasks))]  # so the result does not depend on the workers


def search(
    problem: PlanProblem, *, jobs: int | None = None, exhaustive: bool = False,
    progress: Callable[[str], None] | None = None,
) -> PlanResult:
    """Search `problem`; `jobs` worker processes (None: up to 2, the CPUs there are), one
    schedule each at a time. `exhaustive`: simulate every candidate that can fit, not only
    those whose bound can still beat their schedule's best."""
    start = time.perf_counter()
    meshes(problem)  # the errors for a GPU count or batch that nothing fits, before any work
    first, second, always = seq_chunk_rounds(problem)
    tasks = [(n, k, False) for n in problem.schedules for k in first]
    if problem.vocab_parallel:  # each schedule also with the vocabulary split, whole sequences
        tasks += [(n, 1, True) for n in problem.schedules]
    outcomes = _run_tasks(problem, tasks, jobs, exhaustive, progress, start)
    chunks = first
    best = max((e.mfu for outcome in outcomes for e in outcome[0] if e.fits), default=0.0)
    if second and (always or best == 0.0):
        if progress is not None:
            why = "long sequences" if best else "nothing fits whole sequences"
            progress(f"plan: {why}; trying {','.join(map(str, second))} sequence chunks")
        tasks = [(n, k, False) for n in problem.schedules for k in second]
        # a chunked candidate is simulated only if it can beat the best whole-sequence plan
        outcomes += _run_tasks(problem, tasks, jobs, exhaustive, progress, start, floor=best)
        chunks = first + second
    evaluated, skipped, runs, pruned = [], [], 0, 0
    for e, s, r, n in outcomes:
        evaluated += e
        skipped += s
        runs += r
        pruned += n
    return PlanResult(problem, tuple(evaluated), tuple(skipped), time.perf_counter() - start, runs, pruned, chunks)
