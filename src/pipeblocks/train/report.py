"""After a run: measured against predicted, per rank, and the timelines side by side.

    >>> report = build_report(schedule, results, memory, warmup=2)  # report.data: the --report JSON; RunRecord's fields
    >>> print(format_report(report.data))
    >>> write_report(report, "run.json", "run.png")   # --report JSON, --plot: the timelines side by side

The prediction uses costs profiled from the run itself:

* times: per global stage, the mean duration of its F, B and W actions over the timed
  steps of the measured timelines (a fused BW counts as B, with W = 0), plus the runtime's
  mean time between two passes of a rank whose second pass had its input already
  (`between_passes_s`, `sim.overhead.local_gaps`): what a pass costs its rank in this run.
  Means, not medians: a step's time is the sum of its passes and of the gaps between
  them, and on a machine whose cores the ranks share, or that other work keeps busy, the
  long tail of both (a rank not scheduled in time) is part of that sum. On a quiet machine
  with a core per rank the two agree and the gaps are a fraction of a millisecond;
* communication: the median delay between a pass ending on one rank and the pass that
  waits for its output starting on another (t_comm);
* memory: per global stage, the saved-activation bytes one microbatch's F leaves (M_B)
  and what B keeps for W (M_W), from `pipeblocks.runtime.profile_stage_memory`;
* sequence chunks: a pass of one chunk is timed per (stage, kind, chunk); a stage's time
  for a whole microbatch is the sum over its chunks, and `seq_time` is each chunk's share.
  Each chunk's memory share (`seq_mem`, from `runtime.profile.profile_chunk_memory`) is
  measured as the runtime holds it (chunk 0 with the K/V buffer of the whole sequence).

The simulator replays the same schedule with those costs: its makespan is
`iteration_time_simulated_s`, its per-rank peak `peak_activation_bytes_predicted`.
`iteration_time_measured_s` is the median, over the steps after the warm-up, of the
measured makespan (first action's start to last action's end, over all ranks): the
quantity the simulator predicts. `step_time_s` is the median wall time of a whole step
(first rank starting to last rank finishing, optimizer and timeline gather included), and
`tokens_per_s_measured` the step's tokens (all replicas) over it.
`cores`, `local_ranks` and `load_average` say what else the CPU time went to: the
simulated side gives every rank cores of its own, so the report notes (`contention_notes`)
when ranks outnumber cores or the machine was busy; run p x dp <= cores for a prediction
that holds. `bubble_ratio_measured` is the Timeline definition (makespan minus the busiest rank's
compute, over makespan) on the measured events, the median over the timed steps;
`bubble_ratio_simulated` the same on the simulated timeline, the time between passes that
its passes carry counted as idle there too (`passes_bubble`).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from ..core.ir.actions import Action, Kind
from ..core.ir.schedule import Schedule, write_atomically
from ..core.cost.costs import BlockCosts, Costs
from ..core.cost.dp_model import DPCostModel, Link
from ..core.ir.dp_units import DPUnits
from ..core.ir.sharding import parse_sharding
from ..core.simulator.simulate import simulate, simulate_program
from ..core.simulator.timeline import Timeline
from ..core.ir.vocab import VocabCosts, VocabPass
from ..core.util.jsontext import json_text
from ..resolve.program import Lowering
from ..sim.overhead import handover_gaps, local_gaps

__all__ = ["RankResult", "RunRecord", "format_bytes", "RunReport", "profiled_costs", "iteration_times", "build_report",
           "format_report", "machine_load", "write_report", "write_timeline_plot"]


@dataclass(frozen=True)
class RankResult:
    """What one rank sends back to the launcher."""

    rank: int
    stages: tuple[int, ...]
    losses: tuple[tuple[int, float], ...] = ()
    """(step, loss) for each step run; only the rank holding the last stage has them."""
    step_spans: tuple[tuple[int, float, float], ...] = ()
    """(step, start, end) on the machine-wide perf_counter clock."""
    peak_activation_bytes: int = 0
    """The largest saved-activation footprint over all steps."""
    timelines: tuple[tuple[int, Timeline], ...] = ()
    """Rank 0 only: (step, measured Timeline of all ranks) for the latest steps."""
    grads: dict | None = None
    """Gradients by parameter name after one step (--verify)."""
    params: dict | None = None
    """Parameters by name after the step's optimizer step (--verify)."""
    checks: tuple = ()
    """(step, post_validation.StepCheck) of the steps --verify took."""
    skipped_steps: tuple[int, ...] = ()
    """Steps (0-based) skipped for a non-finite gradient."""
    dp_rank: int = 0
    """The data-parallel replica this pipeline rank belongs to."""
    static_bytes_measured: int = 0
    """The largest parameter + gradient + optimizer-state bytes held (sampled at the step's peak)."""
    static_bytes_predicted: int = 0
    """What core.cost.static_memory predicts for it."""
    dp_wait_s: tuple[float, ...] = ()
    """Per step: time the rank waited on data-parallel communication (exposed)."""
    dp_link: tuple[float, float] | None = None
    """The dp group's measured (bytes/s, latency s per ring step), for the simulator."""
    eval_losses: tuple[tuple[int, float], ...] = ()
    """(step, held-out loss) after the steps --eval-every evaluated; the last stage's rank only."""
    tp_rank: int = 0
    """The rank in the tensor-parallel group (0 without tensor parallelism)."""


@dataclass(frozen=True)
class RunReport:
    """`data` is the `--report` JSON; the timelines are for plotting (an asynchronous run's:
    its steady state's, None without one)."""

    data: dict
    measured: Timeline | None
    simulated: Timeline | None


def profiled_costs(schedule: Schedule, timelines: Sequence[Timeline], m_b: Sequence[float],
                   m_w: Sequence[float], seq_mem: Sequence[float] | None = None) -> Costs:
    """Per-stage costs (seconds, bytes) from measured timelines and per-stage memory: each
    pass at its mean measured duration plus the mean time between passes (module doc)."""
    k = schedule.seq_chunks
    durations: dict[tuple[int, Kind, int], list[float]] = defaultdict(list)
    for timeline in timelines:
        for events in timeline.events:
            for e in events:
                if type(e.action) is not Action:
                    continue  # a recomputation is simulated with its forward's time
                durations[(e.action.stage, e.action.kind, e.action.seq_chunk or 0)].append(e.end - e.start)

    between = between_passes(timelines)

    def chunk_mean(stage: int, kind: Kind, chunk: int) -> float:
        values = durations.get((stage, kind, chunk))
        return statistics.fmean(values) + between if values else 0.0

    def mean(stage: int, kind: Kind) -> float:
        return sum(chunk_mean(stage, kind, c) for c in range(k))

    S = schedule.num_stages
    seq_time = None
    if k > 1:
        per_chunk = [sum(chunk_mean(s, kind, c) for s in range(S) for kind in Kind) for c in range(k)]
        seq_time = tuple(x / sum(per_chunk) for x in per_chunk) if sum(per_chunk) > 0 else None
    split = {s for s in range(S) if (s, Kind.B, 0) in durations}
    t_f = tuple(mean(s, Kind.F) for s in range(S))
    t_b = tuple(mean(s, Kind.B) if s in split else mean(s, Kind.BW) for s in range(S))
    t_w = tuple(mean(s, Kind.W) if s in split else 0.0 for s in range(S))
    total = sum(m_b)
    ratio = min(1.0, sum(m_w) / total) if schedule.has_split_backward and total > 0 else 1.0
    gaps = [gap for timeline in timelines for gap in handover_gaps(timeline)]
    return Costs(t_f=t_f, t_b=t_b, t_w=t_w, mem_b=tuple(float(x) for x in m_b), mem_w_ratio=ratio,
                 t_comm=statistics.median(gaps) if gaps else 0.0, seq_time=seq_time,
                 seq_mem=tuple(seq_mem) if seq_mem is not None and k > 1 else None)


def between_passes(timelines: Sequence[Timeline]) -> float:
    """The runtime's mean time between two passes of a rank when the second's input was
    already there (0 without such a pair)."""
    gaps = [gap for timeline in timelines for gap in local_gaps(timeline)]
    return statistics.fmean(gaps) if gaps else 0.0


def vocab_pass_costs(timelines: Sequence[Timeline], t_comm: float) -> VocabCosts:
    """The vocabulary passes at their mean measured duration per kind (IF, S, T, IB) plus the
    time between passes, as `profiled_costs` prices the stages' passes; X's and the embedding
    gradient's transfers at the measured hop `t_comm`. The all-reduces (C0, IF's) are not
    measured apart: they cost nothing here, and what they take shows as measured over simulated."""
    durations: dict[str, list[float]] = defaultdict(list)
    for timeline in timelines:
        for events in timeline.events:
            for e in events:
                if type(e.action) is VocabPass:
                    durations[e.action.kind].append(e.end - e.start)
    between = between_passes(timelines)
    mean = {kind: statistics.fmean(values) + between if values else 0.0 for kind, values in durations.items()}
    return VocabCosts(t_if=mean.get("IF", 0.0), t_s=mean.get("S", 0.0), t_t=mean.get("T", 0.0),
                      t_ib=mean.get("IB", 0.0), t_bcast=t_comm, t_ib_bcast=t_comm)


def _simulate_vocab(schedule: Schedule, costs: Costs, placed: Costs, timed: Sequence[Timeline], recompute,
                    recompute_at) -> Timeline:
    """The Program lowered as the runner lowers it (the passes placed by `placed`), simulated
    with the measured pass times."""
    dp = costs.data_parallel
    lowering = Lowering(tuple(dp.sharding), dp.dp, costs.dp_units(schedule.num_stages), recompute,
                        recompute_at or {}, placed)
    program = lowering.program(schedule)
    return simulate_program(program, dataclasses.replace(costs, vocab=vocab_pass_costs(timed, costs.t_comm)))


def passes_bubble(simulated: Timeline, between: float) -> float:
    """The simulated timeline's bubble ratio with the time between passes counted as idle, as
    the measured bubble counts it (the simulated passes carry it in their durations)."""
    span = simulated.makespan
    if span <= 0:
        return 0.0
    busy = [simulated.busy(r) - between * sum(1 for e in events if type(e.action) in (Action, VocabPass))
            for r, events in enumerate(simulated.events)]
    return (span - max(busy)) / span


def eval_loss_rows(results: Sequence) -> list[dict]:
    """The report's `eval_losses` (either mode's): [{step (1-based), loss}] from the rank that evaluated."""
    return [{"step": s + 1, "loss": loss} for s, loss in next((r.eval_losses for r in results if r.eval_losses), ())]


def iteration_times(results: Sequence[RankResult]) -> list[tuple[int, float]]:
    """(step, first start to last end over the ranks), in step order."""
    spans: dict[int, tuple[float, float]] = {}
    for result in results:
        for step, start, end in result.step_spans:
            lo, hi = spans.get(step, (start, end))
            spans[step] = (min(lo, start), max(hi, end))
    return [(step, hi - lo) for step, (lo, hi) in sorted(spans.items())]


@dataclass(frozen=True)
class RunRecord:
    """One synchronous run as its report reads it: the schedule run, every rank's result, the
    profiled memory (`memory[s]` has .m_b and .m_w of stage s), and how the run was set up."""

    schedule: Schedule
    results: Sequence[RankResult]
    memory: Sequence
    warmup: int
    """steps left out of the timed medians at the start"""
    emulated: bool = False
    """the run slept instead of computing, so it saved no activations, made no gradients and
    learned nothing: measured peaks (activations and static bytes) and losses are null / empty"""
    seq_mem: Sequence[float] | None = None
    """with sequence chunks, each chunk's saved bytes as a fraction of a whole microbatch's
    (`runtime.profile.profile_chunk_memory`); None: even shares"""
    dp: int = 1
    """the mesh's replicas: rows are per process (pipeline rank, replica)"""
    sharding: Sequence[str] = ("replicate",)
    """the per-chunk policies"""
    stage_param_bytes: Sequence[float] | None = None
    """with dp > 1, the stages' parameter bytes (fp32-parameter units of 4 bytes): the
    simulator replays the step's DP ops on the link the run measured (`dp_link`, a ring
    all-reduce fit), which gives `dp_comm_exposed_s_simulated`"""
    recompute: Iterable[tuple[int, int]] = ()
    """the (stage, microbatch) pairs the run recomputed; the simulator replays them, a
    recomputed forward keeping the stage input (`memory[s].input_ratio` of M_B, when the
    memory comes from `profile_stage_memory`); per rank the report then gives the
    recomputation's time measured and simulated and the simulated part that lengthens the
    rank's step (`recompute_exposed_s_simulated`); the step's is `recompute_step_cost_s_simulated`"""
    dp_units: DPUnits | None = None
    """at block grain, the run's DP units (per unit of equal blocks, as the emulated link times them)"""
    tokens_per_step: int | None = None
    """the tokens of one step over all replicas, for `tokens_per_s_measured` (null without it)"""
    recompute_at: object = None
    """where the run ran the recomputations (those moved into idle time)"""
    vocab: Costs | None = None
    """under --vocab-parallel, the costs the runner placed the IF, S, T and IB passes by
    (`vocab_setup.vocab_costs`): the simulator replays the Program so placed, each pass at its
    mean measured duration (`vocab_pass_costs`)"""


def build_report(schedule: Schedule, results: Sequence[RankResult], memory: Sequence, **record) -> RunReport:
    """Compare the run with the simulator's replay of it; `record`: the other fields of its
    `RunRecord` (`warmup` at least; see there what each adds). The static bytes (parameters,
    gradients, optimizer state) are measured at the step's peak and predicted by
    `core.cost.static_memory`; `dp_comm_exposed_s_measured` is the median over the timed steps
    of the time the rank waited on data-parallel communication. The keys the asynchronous
    report shares are `train.report_keys.SHARED_KEYS`."""
    run = RunRecord(schedule, results, memory, **record)
    emulated = run.emulated
    by_rank = sorted(run.results, key=lambda r: (r.dp_rank, r.rank))
    timelines = next((r.timelines for r in by_rank if r.timelines), ())
    if not timelines:
        raise ValueError("no measured timeline came back: rank 0 records one per step")
    first = min(step for r in by_rank for step, _, _ in r.step_spans) + run.warmup
    timed = [t for step, t in timelines if step >= first] or [timelines[-1][1]]
    link = next((r.dp_link for r in by_rank if r.dp_link is not None), None)
    costs = _replayed_costs(run, timed, link)
    if run.vocab is None:
        simulated = simulate(schedule, costs, recompute=frozenset(run.recompute), recompute_at=run.recompute_at)
    else:
        simulated = _simulate_vocab(schedule, costs, run.vocab, timed, frozenset(run.recompute), run.recompute_at)
    recomputed = bool(simulated.recompute_exposed)
    walls = [t for _, t in iteration_times(run.results)]
    walls = walls[run.warmup:] or walls[-1:]
    losses = () if emulated else next((r.losses for r in by_rank if r.losses), ())
    step_time = statistics.median(walls)
    tokens = run.tokens_per_step
    data = {
        "schedule": schedule.name,
        "p": schedule.p,
        "m": schedule.m,
        "v": schedule.v,
        "seq_chunks": schedule.seq_chunks,
        "dp": run.dp,
        "sharding": list(run.sharding),
        "seq_mem": list(costs.seq_mem) if costs.seq_mem is not None else None,
        "emulated": emulated,
        "steps_timed": len(timed),
        "iteration_time_measured_s": statistics.median(t.makespan for t in timed),
        "iteration_time_simulated_s": simulated.makespan,
        "bubble_ratio_measured": statistics.median(t.bubble_ratio for t in timed),
        "bubble_ratio_simulated": passes_bubble(simulated, between_passes(timed)),
        "step_time_s": step_time,
        "tokens_per_s_measured": tokens / step_time if tokens and step_time > 0 else None,
        "t_comm_s": costs.t_comm,
        "between_passes_s": between_passes(timed),
        **({"recompute_step_cost_s_simulated": simulated.recompute_step_cost} if recomputed else {}),
        "losses": [{"step": s + 1, "loss": loss} for s, loss in losses],
        "eval_losses": eval_loss_rows(by_rank),
        "stages": [
            {"stage": s, "f_s": costs.t_f[s], "b_s": costs.t_b[s], "w_s": costs.t_w[s],
             "activation_bytes": memory[s].m_b, "kept_for_w_bytes": memory[s].m_w}
            for s in range(schedule.num_stages)
        ],
        "ranks": _rank_rows(run, by_rank, simulated, timed, link),
    }
    return RunReport(data, timed[-1], simulated)


def _replayed_costs(run: RunRecord, timed: Sequence[Timeline], link) -> Costs:
    """The costs the simulator replays the run with: profiled from its timed steps, with the
    dp link and parameter bytes (dp > 1) and what a recomputed forward keeps (profiled memory)."""
    memory = run.memory
    costs = profiled_costs(run.schedule, timed, [x.m_b for x in memory], [x.m_w for x in memory], run.seq_mem)
    if run.dp > 1 and link is not None and run.stage_param_bytes is not None:
        params = tuple(b / 4 for b in run.stage_param_bytes)
        units = run.dp_units
        blocks = None if units is None else BlockCosts.even(tuple(max(1, sum(sizes)) for sizes in units.sizes), params)
        costs = dataclasses.replace(
            costs, params=params, blocks=blocks,
            data_parallel=DPCostModel(dp=run.dp, sharding=parse_sharding(list(run.sharding)),
                                       link=Link(bandwidth=link[0], latency=link[1]),
                                       unit="chunk" if units is None else "block",
                                       prefetch=None if units is None else units.prefetch),
        )
    if all(hasattr(x, "input_ratio") for x in memory):  # profiled: what a recomputed forward keeps
        costs = dataclasses.replace(costs, recompute_input_ratio=tuple(x.input_ratio for x in memory))
    return costs


def _rank_rows(run: RunRecord, by_rank: Sequence[RankResult], simulated: Timeline, timed: Sequence[Timeline],
               link) -> list[dict]:
    """One row per process (pipeline rank, replica): memory and exposed communication and
    recomputation, measured beside simulated."""
    emulated, dp, p = run.emulated, run.dp, run.schedule.p
    recomputed = bool(simulated.recompute_exposed)
    measured_recompute = [statistics.median(t.recompute_time[r] for t in timed) for r in range(p)]
    exposed = list(simulated.exposed_comm) or [0.0] * p
    return [
        {
            "rank": r.rank,
            "dp_rank": r.dp_rank,
            "stages": list(r.stages),
            "peak_activation_bytes_measured": None if emulated else r.peak_activation_bytes,
            "peak_activation_bytes_predicted": simulated.peak_activation[r.rank],
            # emulated passes make no gradients: what the rank held is not the run's static memory
            "static_bytes_measured": None if emulated else r.static_bytes_measured,
            "static_bytes_predicted": r.static_bytes_predicted,
            "dp_comm_exposed_s_measured": statistics.median(r.dp_wait_s[run.warmup:] or r.dp_wait_s)
            if r.dp_wait_s else (0.0 if dp == 1 else None),
            "dp_comm_exposed_s_simulated": exposed[r.rank] if dp == 1 or link is not None else None,
            **({"recompute_s_measured": measured_recompute[r.rank],
                "recompute_s_simulated": simulated.recompute_time[r.rank],
                "recompute_exposed_s_simulated": simulated.recompute_exposed[r.rank]} if recomputed else {}),
        }
        for r in by_rank
    ]


def machine_load(local_ranks: int, device: str) -> dict:
    """What else the run's CPU time went to: this machine's cores, the ranks on it, and the
    1-minute load average when the report is made (os.getloadavg; None where there is none).
    On the CPU the simulated side assumes every rank has cores of its own: ranks that
    outnumber the cores, or other work on them, make the measured times longer."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return {"cores": os.cpu_count() or 1, "local_ranks": local_ranks, "load_average": load, "device": device}


def contention_notes(data: dict) -> list[str]:
    """One line each when ranks outnumber the cores, or the machine was busy, on the CPU."""
    if data.get("device", "cpu") != "cpu" or "cores" not in data:
        return []
    cores, ranks, load = data["cores"], data["local_ranks"], data["load_average"]
    notes = []
    if ranks > cores:
        notes.append(f"note: {ranks} ranks share {cores} cores: their passes wait for a core, which the simulated "
                     f"time counts only as far as this run measured it; give -p x --dp <= {cores} for a prediction "
                     "that holds on another run")
    if load is not None and load > cores + 0.5:
        notes.append(f"note: the machine was busy (load average {load:.1f} on {cores} cores at the end of the run): "
                     "other work lengthened the measured times")
    return notes


def _shown_bytes(measured: int | None) -> str:
    return "n/a (emulated)" if measured is None else format_bytes(measured)


def format_report(data: dict) -> str:
    lines = [
        f"schedule {data['schedule']}  p={data['p']} m={data['m']} v={data['v']}"
        + (f" seq_chunks={data['seq_chunks']}" if data.get("seq_chunks", 1) > 1 else "")
        + ("   (emulated compute)" if data.get("emulated") else ""),
        f"iteration time  measured {data['iteration_time_measured_s'] * 1e3:8.1f} ms   "
        f"simulated {data['iteration_time_simulated_s'] * 1e3:8.1f} ms   (median of {data['steps_timed']} steps; "
        f"whole step {data['step_time_s'] * 1e3:.1f} ms)",
        f"bubble ratio    measured {data['bubble_ratio_measured']:8.3f}      "
        f"simulated {data['bubble_ratio_simulated']:8.3f}",
        f"data parallel   dp={data.get('dp', 1)}  sharding {','.join(data.get('sharding', ['replicate']))}",
        "rank  dp  stages   peak activation: measured   predicted   measured/predicted"
        "   static: measured   predicted   DP comm exposed: measured / simulated",
    ]
    lines[3:3] = contention_notes(data)
    if data.get("between_passes_s") is not None:
        lines.insert(3, f"between passes  {data['between_passes_s'] * 1e3:.2f} ms on average (the runtime's own time, "
                        "and a rank waiting for a core; in the simulated time)")
    for row in data["ranks"]:
        measured, predicted = row["peak_activation_bytes_measured"], row["peak_activation_bytes_predicted"]
        ratio = f"{measured / predicted:.3f}" if predicted and measured is not None else "-"
        stages = ",".join(map(str, row["stages"]))
        exposed, exposed_sim = row.get("dp_comm_exposed_s_measured"), row.get("dp_comm_exposed_s_simulated")
        lines.append(
            f"{row['rank']:>4}  {row.get('dp_rank', 0):>2}  {stages:<7}  {_shown_bytes(measured):>25}   "
            f"{format_bytes(predicted):>9}   {ratio:>18}   {_shown_bytes(row.get('static_bytes_measured', 0)):>16}   "
            f"{format_bytes(row.get('static_bytes_predicted', 0)):>9}   "
            + ("-" if exposed is None else f"{exposed * 1e3:.2f} ms") + " / "
            + ("-" if exposed_sim is None else f"{exposed_sim * 1e3:.2f} ms")
        )
    if "recompute_step_cost_s_simulated" in data:
        lines.append("recomputation   per rank: time measured / simulated, simulated part that lengthens the rank's "
                     f"step; the step {data['recompute_step_cost_s_simulated'] * 1e3:.2f} ms longer (simulated)")
        lines.extend(f"{row['rank']:>4}  {row.get('dp_rank', 0):>2}  {row['recompute_s_measured'] * 1e3:9.2f} ms / "
                     f"{row['recompute_s_simulated'] * 1e3:.2f} ms   exposed {row['recompute_exposed_s_simulated'] * 1e3:.2f} ms"
                     for row in data["ranks"])
    return "\n".join(lines)


def write_report(built: RunReport, report: str | None, plot: str | None) -> list[str]:
    """Write `built.data` (a RunReport, either mode's) as the --report JSON and its timelines to
    --plot (default: beside the report, as .png; none without a measured timeline); the lines
    to print."""
    out = []
    if report:
        write_atomically(Path(report), json_text(built.data, indent=1) + "\n")
        out.append(f"report   {report}")
    plot = plot or (str(Path(report).with_suffix(".png")) if report else None)
    if plot and built.measured is not None:
        out.append(f"timeline {write_timeline_plot(built.measured, built.simulated, plot)}")
    return out


def write_timeline_plot(measured: Timeline, simulated: Timeline, path: str | os.PathLike) -> Path:
    """The one place that draws: the measured timeline (with memory) under the simulated one."""
    from ..sim.plots import plot_timeline

    return plot_timeline(
        measured, path, title=f"measured (last timed step)  bubble {measured.bubble_ratio:.3f}", compare=simulated,
        compare_label=f"simulated with profiled costs  bubble {simulated.bubble_ratio:.3f}",
        time_unit="s", memory_unit="bytes",
    )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
