"""Building a schedule and its costs from a `ScheduleRequest`, once.

A generator receives only the options it accepts (its keyword parameters); an option the
user gave that the schedule does not take is an error, not silently dropped. A cost-aware
generator gets the request's costs resolved for the stage count it will build, which the
registry tells without building, so every generator runs exactly once per request.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..core.cost.costs import Costs, parse_costs, repeat_stages
from ..core.cost.dp_model import UNIT_LINK, DPCostModel, Link
from ..core.ir.errors import ScheduleError
from ..core.ir.actions import Action
from ..core.simulator.simulate import simulate_lowered
from ..core.simulator.timeline import Timeline
from ..core.ir.program import Program
from .request import CostSpec, ScheduleRequest
from ..core.ir.sharding import ShardingPolicy
from ..core.ir.schedule import Schedule, read_text_file
from ..interop import from_torch_csv, program_from_torch_csv
from ..schedules import get
from ..schedules.sequence import split_sequence
from ..sim.analytic import HF_SEQ, TransformerConfig, dp_link, model_from_hf, parse_model, stage0_backward_in_w, transformer_costs
from ..sim.tp_costs import tensor_parallel_costs
from ..core.lowering.recompute import all_pairs, recompute_pairs
from .auto_sharding import choose_sharding
from .program import Lowering
from ..sim.blocks import transformer_blocks
from .elastic_plan import choose_elastic_plan
from ..sim.hardware_profile import resolve_hardware
from .recompute_auto import choose_recompute, minimal_recompute
from .recompute_place import place_recompute
from ..sim.vocab_costs import with_vocab_parallel
from ..sim.sequence_split import with_chunk_shares
from .split_auto import SplitChoice, balanced_counts, choose_split
from ..core.cost.split import AUTO, check_split, layer_counts, rank_balanced

__all__ = [
    "Built", "build", "data_parallel", "memory_budget", "resolve_costs", "model_config", "stage_model_config",
    "SplitChosen", "choose_split_for",
]

_LOWERED_CELL = re.compile(r"\d(?:SEND_|RECV_|UNSHARD|RESHARD|REDUCE_GRAD)")

# generator keyword -> the flag that sets it, for messages
_FLAGS = {
    "v": "-v", "group_size": "--group-size", "memory_limit": "--memory-limit",
    "forward_groups": "--forward-groups", "backward_groups": "--backward-groups",
}


@dataclass(frozen=True)
class Built:
    """A request's schedule and the costs it is simulated with."""

    request: ScheduleRequest
    schedule: Schedule
    costs: Costs
    recompute: frozenset[tuple[int, int]] = frozenset()
    """(stage, microbatch) pairs to recompute (`--recompute`); pass to `simulate(..., recompute=)`"""
    recompute_at: Mapping[tuple[int, int, int], Action] = field(default_factory=dict)
    """where a recomputation runs in idle time, earlier than before its backward
    (`recompute_place.place_recompute`): pass to `simulate(..., recompute_at=)`"""

    def program(self) -> Program:
        """The Program the simulator and the runtime run for this request: its mesh's DP ops
        and its recomputations, where they were placed (`program.Lowering`)."""
        lowering = Lowering.of(self.schedule, self.costs, recompute=self.recompute, recompute_at=self.recompute_at)
        return lowering.program(self.schedule)

    def simulate(self) -> Timeline:
        """The request's Program (`program`) simulated with its costs."""
        return simulate_lowered(self.schedule, self.program, self.costs)


def build(request: ScheduleRequest) -> Built:
    """The schedule the request describes (generated once) and its resolved costs; with
    `auto_sharding`, the policies the simulator chose are in the returned request and costs;
    with `recompute`, the pairs to recompute (auto: chosen after the sharding)."""
    if request.recompute == "auto" and request.gpu_memory is None:
        raise ScheduleError(
            "--recompute auto chooses the pairs to recompute so that each rank fits --gpu-memory, but no "
            "--gpu-memory was given: give --gpu-memory GB, or use --recompute all / none"
        )
    if request.costs.split == AUTO:
        request = choose_split_for(request).request
    return _placed(_chosen(request), request)


@dataclass(frozen=True)
class SplitChosen:
    """`--split auto` resolved: the request with the chosen counts, and what was compared."""

    request: ScheduleRequest
    choice: SplitChoice


def choose_split_for(request: ScheduleRequest) -> SplitChosen:
    """The layer counts `--split auto` chooses for `request` (`split_auto.choose_split`), within
    --gpu-memory when given. The search simulates each candidate's costs on the schedule,
    sharding and recomputation built for the even split (a cost-aware generator is not run
    again for every candidate); the split found is then built as the request would be, and
    kept if that build is at least as fast as the even split's and fits."""
    if not request.costs.analytic:
        raise ScheduleError("--split auto prices every stage's layers, embedding and head with the analytic model: "
                            "give --model PRESET or --hf DIR (and --hardware), or give the counts (--split 3,4,4,3)")

    def with_split(counts: tuple[int, ...] | None) -> ScheduleRequest:
        return dataclasses.replace(request, costs=dataclasses.replace(request.costs, split=counts))

    even = _placed(_chosen(with_split(None)), with_split(None))
    stages = even.schedule.num_stages
    config = model_config(request.costs)
    counts = config.stage_layers(stages)
    totals = [f + b + w for f, b, w in zip(even.costs.t_f, even.costs.t_b, even.costs.t_w)]
    per_layer = totals[0] / counts[0]  # stage 0's time is its layers' (the embedding is a lookup)
    fixed = [t - n * per_layer for t, n in zip(totals, counts)]

    schedule = even.schedule

    def score(candidate: tuple[int, ...]) -> tuple[float, float]:
        if candidate == counts:
            timeline = even.simulate()
        else:
            costs = resolve_costs(with_split(candidate).costs, stages, schedule.seq_chunks, tp=request.mesh.tp,
                                  p=request.p)
            costs = dataclasses.replace(costs, data_parallel=even.costs.data_parallel)
            timeline = dataclasses.replace(even, costs=costs).simulate()
        return timeline.makespan, max(timeline.memory_need)

    budget = memory_budget(request)
    choice = choose_split(score, layers=config.layers, num_stages=stages, budget=budget,
                          starts=(balanced_counts(config.layers, per_layer, fixed),), unit=1e9, memory_unit=" GB")
    if choice.counts != counts:  # built as the request builds it: a cost-aware order for these costs
        timeline = _placed(_chosen(with_split(choice.counts)), with_split(choice.counts)).simulate()
        step, need = timeline.makespan, max(timeline.memory_need)
        if (budget is None or need <= budget) and step <= choice.even_step:
            choice = dataclasses.replace(choice, step=step, need=need)
        else:
            choice = dataclasses.replace(choice, counts=counts, step=choice.even_step, need=choice.even_need)
    return SplitChosen(with_split(choice.counts), choice)


def _placed(built: Built, request: ScheduleRequest) -> Built:
    """`built` with its recomputations moved into idle time where they fit (`place_recompute`)."""
    pairs = recompute_pairs(built.schedule, built.recompute)  # --recompute's, or the schedule's own (1f1b-r)
    if not pairs:
        return built
    budget = memory_budget(request) if request.gpu_memory is not None else None
    at = place_recompute(built.schedule, built.costs, pairs, budget=budget)
    return dataclasses.replace(built, recompute_at=at) if at else built


def _chosen(request: ScheduleRequest) -> Built:
    """The schedule, its costs, its sharding and its recomputed pairs, before placement."""
    if _joint_elastic(request):
        return _build_elastic_plan(request)
    built = _build(request)
    if request.auto_sharding:
        budget = memory_budget(request)
        chosen = choose_sharding(built.schedule, built.costs, memory_budget=budget)
        built = Built(dataclasses.replace(request, sharding=chosen), built.schedule, built.costs.with_sharding(chosen))
    if request.recompute == "all":
        return dataclasses.replace(built, recompute=all_pairs(built.schedule))
    if request.recompute == "auto":
        unit = 1e9 if request.costs.analytic else 1.0
        pairs = choose_recompute(built.schedule, built.costs, memory_budget(request), unit=unit)
        return dataclasses.replace(built, recompute=pairs)
    return built


def _joint_elastic(request: ScheduleRequest) -> bool:
    """`elastic` without explicit groups, with `--sharding auto` or `--recompute auto`: groups
    and sharding are chosen together, or the groups with recomputation in view
    (`elastic_plan`)."""
    given = dict(request.options)
    return (
        (request.auto_sharding or (request.recompute == "auto" and request.gpu_memory is not None))
        and not request.file and request.name == "elastic" and request.seq_chunks is None
        and given.get("forward_groups") is None and given.get("backward_groups") is None
        and given.get("search", True) is not False and request.recompute != "all"
    )


def _build_elastic_plan(request: ScheduleRequest) -> Built:
    given = dict(request.options)
    v = given.get("v", 2)
    unknown = sorted(set(given) - {"v", "search", "forward_groups", "backward_groups"})
    if unknown:
        raise ScheduleError(f"schedule 'elastic' has no option {unknown[0]!r}; it takes v, forward_groups, backward_groups, search")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ScheduleError(f"v must be an integer >= 1, got {v!r}")
    stages = request.p * v
    if request.auto_sharding:
        start = (ShardingPolicy.ZERO3,) if request.mesh.dp > 1 else (ShardingPolicy.REPLICATE,)
    else:
        start = request.sharding
    costs = _with_dp(dataclasses.replace(request, sharding=start), resolve_costs(request.costs, stages, p=request.p), stages)
    plan = choose_elastic_plan(
        request.p, request.m, v, costs, budget=memory_budget(request), recompute=request.recompute == "auto",
        start=start, unit=1e9 if request.costs.analytic else 1.0, search_sharding=request.auto_sharding,
    )
    chosen = dataclasses.replace(request, sharding=plan.sharding) if request.auto_sharding else request
    final = costs.with_sharding(plan.sharding if request.auto_sharding else start)
    pairs = plan.recompute
    if pairs and request.recompute == "auto" and pairs != all_pairs(plan.schedule):
        # the search scored its candidates with the greedy choice; the one chosen recomputes only what binds
        pairs = minimal_recompute(plan.schedule, final, memory_budget(request), sorted(pairs))
    return Built(chosen, plan.schedule, final, pairs)


def memory_budget(request: ScheduleRequest) -> float | None:
    """--gpu-memory in the costs' memory units: bytes under the analytic model."""
    budget = request.gpu_memory
    if budget is not None and request.costs.analytic:
        budget *= 1e9
    return budget


def _build(request: ScheduleRequest) -> Built:
    if request.file:
        schedule = _load(request.file)
        return Built(request, schedule, _with_dp(request, resolve_costs(request.costs, schedule.num_stages, schedule.seq_chunks, tp=request.mesh.tp, p=request.p), schedule.num_stages))
    spec = get(request.name)
    kwargs: dict[str, object] = {"p": request.p, "m": request.m}
    for key, value in request.options:
        if not spec.accepts(key):
            flag = _FLAGS.get(key)
            if flag is not None:
                raise ScheduleError(f"schedule {spec.name!r} does not take {flag}; drop it or choose another schedule")
            raise ScheduleError(f"schedule {spec.name!r} has no option {key!r}; it takes {sorted(spec.parameters)}")
        kwargs[key] = value
    k = request.seq_chunks
    generate = spec if k is None else functools.partial(split_sequence, spec.name, seq_chunks=k)
    if spec.accepts("gpu_memory") and "gpu_memory" not in kwargs and request.gpu_memory is not None:
        kwargs["gpu_memory"] = memory_budget(request)
    if spec.accepts("costs") and "costs" not in kwargs:
        stages = spec.num_stages(**kwargs)
        costs = _with_dp(request, resolve_costs(request.costs, stages, k or 1, tp=request.mesh.tp, p=request.p), stages)
        schedule = generate(**kwargs, costs=costs)
        if schedule.num_stages != stages:  # the registration's v is wrong: a bug, not user input
            raise RuntimeError(f"schedule {spec.name!r} built {schedule.num_stages} stages, registry said {stages}")
        return Built(request, schedule, costs)
    schedule = generate(**kwargs)
    if schedule.chains > 1 and request.costs.analytic:  # DualPipe: the model's p stages, each held twice
        model = resolve_costs(request.costs, schedule.num_stages // schedule.chains, schedule.seq_chunks,
                              tp=request.mesh.tp, p=request.p)
        costs = repeat_stages(model, schedule.chains)
    else:
        costs = resolve_costs(request.costs, schedule.num_stages, schedule.seq_chunks, tp=request.mesh.tp, p=request.p)
    return Built(request, schedule, _with_dp(request, costs, schedule.num_stages))


def data_parallel(request: ScheduleRequest) -> DPCostModel:
    """The request's mesh, sharding, DP link and precision for the cost model."""
    spec = request.costs
    dp = request.mesh.dp
    if spec.analytic:
        base = dp_link(resolve_hardware(spec.hardware), dp)
        bandwidth = base.bandwidth if spec.dp_bandwidth is None else spec.dp_bandwidth * 1e9
        latency = base.latency if spec.dp_latency is None else spec.dp_latency * 1e-6
    else:  # unit costs: the override is in the units of the costs (see core.cost.dp_model)
        bandwidth = UNIT_LINK.bandwidth if spec.dp_bandwidth is None else spec.dp_bandwidth
        latency = UNIT_LINK.latency if spec.dp_latency is None else spec.dp_latency
    return DPCostModel(
        dp=dp, sharding=request.sharding, link=Link(bandwidth, latency),
        precision="bf16-mixed" if spec.mixed_precision else "fp32", unit=spec.dp_unit,
        prefetch=spec.dp_prefetch,
    )


def _with_dp(request: ScheduleRequest, costs: Costs, num_stages: int) -> Costs:
    """`costs` with the request's data-parallel side; the policy list is checked against
    the schedule's chunks here, before anything runs."""
    dp = data_parallel(request)
    dp.policies(num_stages)
    return dataclasses.replace(costs, data_parallel=dp)


def model_config(spec: CostSpec) -> TransformerConfig:
    """The analytic model `spec` names: a preset or 'L,H,A,S[,V[,B]]' (`model`, with
    `analytic.parse_model`), or the config.json of a Hugging Face directory (`hf`, with
    `analytic.model_from_hf`: an unsupported architecture or a missing file is a ValueError);
    `seq` and `microbatch_size` replace the model's own when given (with `hf`: its context
    at most 4096, and 1), and `flash_attention` is the spec's."""
    if spec.shape is not None:
        config = TransformerConfig.from_shape(spec.shape, seq=spec.seq or HF_SEQ, microbatch_size=spec.microbatch_size or 1,
                                              flash_attention=spec.flash_attention)
    elif spec.hf:
        config = model_from_hf(spec.hf, seq=spec.seq, microbatch_size=spec.microbatch_size or 1,
                               flash_attention=spec.flash_attention)
    elif spec.model:
        config = parse_model(spec.model)
        sizes = {"seq": spec.seq, "microbatch_size": spec.microbatch_size}
        config = dataclasses.replace(config, flash_attention=spec.flash_attention,
                                     **{key: value for key, value in sizes.items() if value is not None})
    else:
        raise ScheduleError("these costs have no analytic model: give --model PRESET|L,H,A,S or --hf DIR")
    return config


def stage_model_config(spec: CostSpec, num_stages: int, *, p: int | None = None) -> TransformerConfig:
    """`model_config(spec)` cut into `num_stages` stages by `spec.split` when it gives counts
    (checked here: one per stage, each >= 1, summing to the layers; `p` names the ranks in
    the error), else by the even rule."""
    config = model_config(spec)
    if isinstance(spec.split, tuple):
        try:
            counts = check_split(spec.split, layers=config.layers, num_stages=num_stages, p=p)
        except ValueError as err:
            raise ScheduleError(str(err)) from None
        config = dataclasses.replace(config, split=counts)
    elif spec.split is None and spec.vocab_parallel:
        # no vocabulary layer on the end stages: the even rule's lighter ends would leave the
        # ranks holding them short (`core.cost.split.rank_balanced`, as the planner cuts them)
        layer_counts(config.layers, num_stages)  # the error when there are fewer layers than stages
        config = dataclasses.replace(config, split=rank_balanced(config.layers, num_stages))
    elif spec.split is not None:  # build() resolves "auto" before any costs are asked
        raise ScheduleError(f"--split {spec.split}: resolve it with resolve.build.build (or choose_split_for) first")
    return config


def resolve_costs(spec: CostSpec, num_stages: int, seq_chunks: int = 1, tp: int = 1, *, p: int | None = None) -> Costs:
    """Costs from the analytic model (`stage_model_config`, for `num_stages` stages cut by
    `spec.split`; with tp > 1 as one of tp tensor-parallel ranks runs them, `tp_costs`), or
    from pass times (unit costs by default; tp is then the runtime's alone, not priced, and
    a split is the runtime's too: `train` builds its stages by it)."""
    if spec.analytic and tp > 1:
        if spec.vocab_parallel:
            raise ScheduleError(f"--vocab-parallel with --tp {tp}: the vocabulary passes are priced over the pipeline "
                                "ranks only; drop --tp or --vocab-parallel")
        if seq_chunks > 1:
            raise ScheduleError(f"--tp {tp} with --seq-chunks {seq_chunks}: tensor parallelism already splits the "
                                "tokens (sequence parallelism); drop one")
        config = stage_model_config(spec, num_stages, p=p)
        costs = resolve_costs(spec, num_stages, seq_chunks, p=p)
        costs = tensor_parallel_costs(costs, config, resolve_hardware(spec.hardware), num_stages=num_stages, tp=tp)
        # stage 0 runs its whole backward in W, its tensor-parallel collectives too
        return stage0_backward_in_w(costs)
    if spec.analytic:
        config = stage_model_config(spec, num_stages, p=p)
        # with sequence chunks stage 0's B has work: the earlier chunks' K/V need their gradient
        costs = transformer_costs(config, resolve_hardware(spec.hardware), num_stages=num_stages,
                                  stage0_input_grad=seq_chunks > 1)
        if spec.mem_w_ratio is not None:
            costs = dataclasses.replace(costs, mem_w_ratio=spec.mem_w_ratio)
        costs = dataclasses.replace(costs, blocks=transformer_blocks(config, num_stages=num_stages))
        costs = with_chunk_shares(costs, config, seq_chunks, spec.seq_split)
        if spec.vocab_parallel:
            if seq_chunks > 1:
                raise ScheduleError(f"--vocab-parallel runs whole microbatches: drop --seq-chunks {seq_chunks}")
            costs = with_vocab_parallel(costs, config, resolve_hardware(spec.hardware), ranks=p or num_stages)
        return costs
    base = parse_costs(spec.times) if spec.times else Costs()
    ratio = 1.0 if spec.mem_w_ratio is None else spec.mem_w_ratio
    return dataclasses.replace(base, mem_w_ratio=ratio)


def _load(file: str) -> Schedule:
    if Path(file).suffix.lower() == ".csv":
        text = read_text_file(file, "schedule file")
        if _LOWERED_CELL.search(text):  # torch's lowered format: the compute order is the schedule
            return program_from_torch_csv(text).schedule
        return from_torch_csv(text, m=None)
    return Schedule.load(file)
