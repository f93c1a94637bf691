"""What every rank of a run builds before its first step, synchronous or asynchronous.

    setup = setup_rank(ctx, cfg)           # ctx: the runtime's DistContext
    runner = PipelineRunner(cfg.schedule.schedule, setup.runner_stages, setup.loss_fn,
                            rank=setup.rank, group=setup.pp_group, data_parallel=setup.data_parallel,
                            precision=setup.copies, ...)

In order: the (pp, dp, tp) mesh when the run is data- or tensor-parallel; this rank's stages
of the model, and only those, with the weights the whole model of the same seed has, or
the model's pretrained weights, of which it reads only its stages' tensors
(`models.build.build_stages`); with tp > 1 each stage split over the tp group while still
on the meta device (`runtime.tensor_parallel.parallelize_stage`, before FSDP2 wraps it),
so each rank fills, and reads, only its shards; the precision (bf16-mixed: FSDP2's
MixedPrecisionPolicy on the chunks it shards, `runtime.precision.ComputeCopies` on the
others); the data-parallel wrapper (FSDP2, ZeroRedundancyOptimizer) before any optimizer is
built over the parameters; the tied embeddings' group (`runtime.tied`); the data; the seed
of torch's generator.

`emulated_costs` is the one rule for emulated compute: each pass sleeps its per-layer
time times the blocks of its stage (`TrainConfig.stage_layers`: --split, or the even rule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..core.cost.dp_model import DPCostModel, Link
from ..core.ir.sharding import ShardingPolicy
from ..data import TokenWindows
from ..models.build import build_stages
from ..runtime.data_parallel import DataParallel
from ..runtime.dp_units import unit_modules
from ..runtime.emulate import EmulatedCosts
from ..runtime.emulated_link import EmulatedLink
from ..runtime.mesh import init_mesh
from ..runtime.precision import ComputeCopies, fsdp_policy, torch_dtype
from ..runtime.tied import TiedWeights
from .config import TrainConfig
from .prepare import dp_units, load_data
from .stage_copies import build_copies
from .tp_predict import tp_emulated_times
from .vocab_setup import emulated_pass_times, strip_vocab, vocab_rank

__all__ = ["RankSetup", "emulated_costs", "setup_rank"]


@dataclass
class RankSetup:
    """One rank's share of the run."""

    rank: int
    """the pipeline rank (rank in the pp group)"""
    replica: int
    """the data-parallel replica (rank in the dp group; 0 without data parallelism)"""
    mesh: Any
    """runtime.mesh.PipelineMesh, or None without data or tensor parallelism"""
    modules: dict[int, torch.nn.Module]
    """global stage -> its module, holding the master weights (what the optimizer, the
    checkpoints and `--verify` see)"""
    runner_stages: dict[int, torch.nn.Module]
    """global stage -> what the runner calls (a CastStage under bf16-mixed, else the module)"""
    copies: Any
    """runtime.precision.ComputeCopies under bf16-mixed (for the chunks FSDP2 does not shard), else None"""
    data_parallel: Any
    """runtime.data_parallel.DataParallel, or None"""
    data: TokenWindows
    loss_fn: Any
    held_out: TokenWindows | None = None
    """the held-out tail of the data (`cfg.held_out` of it; None when nothing is held out)"""
    tied: Any = None
    """runtime.tied.TiedWeights when the model ties its head to its embedding, else None"""
    vocab: Any = None
    """runtime.vocab_step.VocabStep under --vocab-parallel (this rank's rows of the tables), else None"""

    @property
    def stages(self) -> list[torch.nn.Module]:
        """This rank's stage modules in stage order."""
        return [self.modules[s] for s in sorted(self.modules)]

    @property
    def pp_group(self):
        return self.mesh.pp_group if self.mesh is not None else None

    @property
    def tp_rank(self) -> int:
        """The rank in the tensor-parallel group (0 without tensor parallelism)."""
        return self.mesh.tp_rank if self.mesh is not None else 0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The stages' parameters, then this rank's vocabulary rows (under --vocab-parallel)."""
        rows = self.vocab.parameters if self.vocab is not None else []
        return [p for module in self.stages for p in module.parameters()] + rows


def setup_rank(ctx, cfg: TrainConfig) -> RankSetup:
    """Build this rank's stages, precision, data parallelism and data (see the module doc)."""
    spec = cfg.model.spec()
    mesh = None
    if cfg.data_parallel or cfg.tp > 1:
        mesh = init_mesh(cfg.schedule.p, cfg.dp, ctx.device, tp=cfg.tp)
    rank, replica = (mesh.pp_rank, mesh.dp_rank) if mesh is not None else (ctx.rank, 0)
    mine = cfg.schedule.placement.stages_of(rank)
    # TP first (on the meta device), then FSDP2 over the DTensor shards: torchtitan's order
    if cfg.schedule.schedule.chains > 1:  # DualPipe: model stage s mod L for global stage s, one copy per chain
        modules = build_copies(spec, cfg.schedule.schedule, mine, seed=cfg.seed, device=ctx.device,
                               dtype=getattr(torch, cfg.precision.master))
    else:
        built = build_stages(spec, seed=cfg.seed, num_stages=cfg.num_stages, stages=mine, device=ctx.device,
                             dtype=getattr(torch, cfg.precision.master), tp_mesh=mesh.tp_mesh if cfg.tp > 1 else None,
                             counts=cfg.stage_layers)
        modules = {stage.index: stage for stage in built}
    vocab = None
    if cfg.schedule.vocab_parallel:  # the stages without the vocabulary layers; this rank's rows of them
        modules, vocab = _vocab_parallel(cfg, ctx, spec, modules, rank, replica)
    precision = cfg.precision
    cast = {s: m for s, m in modules.items()
            if precision.mixed and not (mesh is not None and ShardingPolicy(cfg.sharding[s]).fsdp)}
    copies = ComputeCopies(cast, torch_dtype(precision.compute)) if cast else None
    runner_stages = {s: copies.stages[s] if s in cast else m for s, m in modules.items()}
    data_parallel = None
    if cfg.data_parallel:
        # FSDP2 replaces the parameters by their shards: build the optimizer after this
        data_parallel = DataParallel(
            modules, cfg.sharding, mesh.dp_mesh, timeout_s=cfg.timeout_s, link=_emulated_link(cfg, modules),
            mp_policy=fsdp_policy(torch_dtype(precision.compute), torch_dtype(precision.reduce))
            if precision.mixed else None,
            extra_static=copies.held if copies is not None else None, units=dp_units(cfg),
        )

    tied = TiedWeights.build(modules, cfg.schedule.placement, mesh=mesh, timeout_s=cfg.timeout_s)
    data, held_out = load_data(cfg.data, cfg.model).split(cfg.held_out)
    torch.manual_seed(cfg.seed)
    return RankSetup(rank, replica, mesh, modules, runner_stages, copies, data_parallel, data, spec.loss,
                     held_out, tied, vocab)


def _vocab_parallel(cfg: TrainConfig, ctx, spec, modules: dict, rank: int, replica: int):
    """(the stages without embedding and head, this rank's `VocabStep`) on its pipeline
    (global rank = pp_rank * dp + replica, runtime.mesh)."""
    p, dp, placement = cfg.schedule.p, cfg.dp, cfg.schedule.placement
    pipelines = [[r * dp + d for r in range(p)] for d in range(dp)]
    vocab = vocab_rank(spec, rank=rank, ranks=pipelines[replica], first=placement.rank_of(0),
                       last=placement.rank_of(cfg.num_stages - 1), seed=cfg.seed,
                       master=getattr(torch, cfg.precision.master), compute=torch_dtype(cfg.precision.compute),
                       tokens=cfg.microbatch_size * cfg.model.sequence, device=ctx.device, timeout_s=cfg.timeout_s,
                       pipelines=pipelines, before_pass=emulated_pass_times(cfg) if cfg.emulation is not None else None)
    return strip_vocab(modules, spec), vocab


def emulated_costs(cfg: TrainConfig):
    """The emulated pass times of `cfg.emulation`: per-layer milliseconds, times the blocks
    of each stage."""
    f, b, w = cfg.emulation.times_ms
    if cfg.tp > 1:  # a tp rank computes 1/tp of a layer and waits on its collectives
        f, b, w = tp_emulated_times(cfg)
    return EmulatedCosts(f_ms=f, b_ms=b, w_ms=w, layers=cfg.stage_layers)


def _emulated_link(cfg: TrainConfig, stages):
    """Under emulation with dp > 1: each DP collective also takes its modelled time on the
    run's link, sized by the parameters of this rank's stages (other stages: never issued)."""
    if cfg.emulation is None or cfg.emulation.link is None:
        return None

    params = [0.0] * cfg.num_stages
    for index, module in stages.items():
        params[index] = float(sum(q.numel() for q in module.parameters()))
    model = DPCostModel(dp=cfg.dp, sharding=tuple(cfg.sharding), link=Link(*cfg.emulation.link))
    units = dp_units(cfg)
    if units is None:
        return EmulatedLink(model, params)

    # each unit's own parameters (the embedding and head with their blocks); other ranks' stages: never issued
    unit_params = [[0.0] * units.count(s) for s in range(cfg.num_stages)]
    for index, module in stages.items():
        if units.count(index) > 1:
            unit_params[index] = [float(sum(q.numel() for m in group for q in m.parameters()))
                                  for group in unit_modules(module, units.sizes[index])]
        else:
            unit_params[index] = [params[index]]
    return EmulatedLink(model, params, units=units, unit_params=unit_params)
