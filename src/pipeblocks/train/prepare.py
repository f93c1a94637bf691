"""From a request to a run: `prepare` finds every user error before any process starts.

    >>> cfg, data = prepare(ScheduleRequest(name="v-half", m=4, mesh=Mesh(pp=2)), model=GPTConfig(), steps=20)
    >>> cfg, data = prepare(request, model=ModelChoice("hf:models/qwen2", seq=256), data=DataSpec("notes.jsonl"))

In order: the model (its spec, resolved once here: a bad directory or spec fails now), the
schedule (built and validated once), what composes with what (`composition.REFUSALS`, on a
draft of the run), whether the model fits the pipeline (layers per stage, tensor-parallel
sizes, its context), the mesh and device, the data (tokenized once, its ids within the
model's vocabulary), the loop's options, and the checkpoint directory. Each step raises
ValueError with the numbers and the fix.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.cost.precision import PrecisionPolicy, precision_policy
from ..core.cost.split import AUTO, check_split, layer_counts, rank_balanced
from ..core.cost.vocab_partition import partition_vocab
from ..core.ir.dp_units import units_for
from ..core.ir.program import Program
from ..core.ir.schedule import Schedule
from ..core.lowering.recompute import recompute_pairs
from ..core.lowering.validate import validate
from ..models.config import GPTConfig
from ..models.tp_plan import check_tp
from ..resolve.build import build, choose_split_for
from ..resolve.program import Lowering
from ..resolve.request import CostSpec, ScheduleRequest
from ..schedules.asynchronous import ASYNC_FORMS
from .composition import Draft, check_composition
from .config import CheckpointSpec, DataSpec, EmulationSpec, MeshSpec, ScheduleSpec, TrainConfig
from .corpus import load_corpus
from .loop_options import resolve_loop_options
from .model_choice import ModelChoice
from .prepare_checks import (
    check_checkpoint_directory, check_torchrun_world, emulated_link, run_device, sequence_chunk_lengths, tp_link,
    warn_tp_across_nodes,
)

if TYPE_CHECKING:
    from ..data import TokenWindows

__all__ = ["prepare", "dp_units", "load_data", "model_choice", "run_lowering", "run_program"]


def prepare(
    request: ScheduleRequest, *, model: Any, family: str | None = None, precision: str | None = None,
    device: str = "cpu", emulate: tuple[float, float, float] | None = None, checkpoint: str | None = None,
    resume: bool = False, save_every: int = 0, overwrite: bool = False, threads_per_rank: int | None = None,
    data: DataSpec | str | None = None, dry_run: bool = False, sizes: tuple[str, ...] = (), vocab_parallel: bool = False,
    **train_options,
) -> tuple[TrainConfig, TokenWindows]:
    """The run's config and training data, every user error raised here (ValueError).

    model: a `ModelChoice`, or a built-in family's config (GPTConfig, LlamaConfig; `family`
        names which: None takes "gpt" for a GPTConfig and "llama" for a LlamaConfig).
    precision: "fp32", "fp64" or "bf16-mixed" (None: the model's dtype, fp32 or fp64).
    device: "auto", "cpu" or "cuda", resolved against this machine's GPUs for its local ranks.
    data: a `DataSpec` (or a path: its text, bytes). dry_run: the run will only be predicted.
    sizes: the size options the command line was given (refused with --hf and --model).
    vocab_parallel: split the embedding and head by vocabulary rows over the pipeline ranks
        (train/vocab_setup.py; `request.costs.vocab_parallel` asks for it too).
    The other options are `TrainConfig`'s loop settings.
    """
    choice = model_choice(model, family)
    spec = choice.spec()
    policy = precision_policy(precision or choice.weights_dtype)
    data = data if isinstance(data, DataSpec) else DataSpec(data)
    request = _resolve_split(request, choice, train_options.get("microbatch_size"))
    built = build(request)  # with --sharding auto, the policies the simulator chose are in built.request
    request, schedule = built.request, built.schedule
    check_composition(_draft(request, schedule, built.recompute, choice, spec, policy, emulate=emulate,
                             checkpoint=checkpoint, resume=resume, save_every=save_every, dry_run=dry_run,
                             sizes=sizes, options=train_options,
                             vocab_parallel=vocab_parallel or request.costs.vocab_parallel))
    if vocab_parallel or request.costs.vocab_parallel:
        part = partition_vocab(choice.vocab, schedule.p)  # a rank without a real row: refused, named
        if part.note() is not None:
            print(f"note: {part.note()}", file=sys.stderr)
    validate(schedule)
    split = _check_fits(choice, schedule, request.mesh.tp, request.costs.split)
    if split is None and (vocab_parallel or request.costs.vocab_parallel):
        # no vocabulary layer on the end stages: cut as simulate and plan do (equal layers per rank)
        split = rank_balanced(choice.layers, schedule.num_stages)
    from ..models.build import check_weights  # torch: --dry-run and the CLI's parsing must not import it here

    check_weights(spec)  # a pretrained model's files hold every tensor, in its shape (headers only)
    dp, tp = request.mesh.dp, request.mesh.tp
    check_torchrun_world(schedule.p * dp * tp, tp)
    mesh = MeshSpec(dp, request.sharding, run_device(device, schedule.p * dp * tp, policy), threads_per_rank, tp,
                    dp_unit=request.costs.dp_unit)
    warn_tp_across_nodes(tp, mesh.device)
    emulation = None if emulate is None else EmulationSpec(
        tuple(emulate), emulated_link(request) if mesh.data_parallel else None,
        tp_link=tp_link(request) if tp > 1 else None)
    corpus = load_data(data, choice)
    options, train_data = resolve_loop_options(
        train_options, corpus, checkpoint=checkpoint, resume=resume, emulate=emulate, p=schedule.p,
        hidden=choice.hidden, async_mode=train_options.get("async_mode"))
    ck = CheckpointSpec(checkpoint, resume=resume, save_every=save_every, overwrite=overwrite) if checkpoint else None
    scheduled = ScheduleSpec(schedule, sequence_chunk_lengths(schedule, request.costs.seq_split, choice),
                             recompute_pairs(schedule, built.recompute),  # --recompute's, or the schedule's own
                             recompute_at=built.recompute_at,  # where the simulator moved them into idle time
                             split=split, vocab_parallel=vocab_parallel or request.costs.vocab_parallel)
    cfg = TrainConfig(model=choice, schedule=scheduled, mesh=mesh, precision=policy, checkpoint=ck,
                      emulation=emulation, data=data, **options)
    _check_batch(cfg, train_data)
    check_checkpoint_directory(cfg, train_data)
    return cfg, train_data


def model_choice(model: Any, family: str | None = None) -> ModelChoice:
    """A `ModelChoice` from what `prepare` was given (a choice, or a built-in family's config)."""
    if isinstance(model, ModelChoice):
        return model
    family = family or ("gpt" if isinstance(model, GPTConfig) else "llama")
    return ModelChoice(family, model)


def _draft(request: ScheduleRequest, schedule: Schedule, recompute, choice: ModelChoice, spec, policy: PrecisionPolicy,
           *, emulate, checkpoint, resume, save_every, dry_run, sizes, options: dict, vocab_parallel: bool = False) -> Draft:
    """The run as `composition.check_composition` reads it."""
    async_mode = options.get("async_mode")
    return Draft(
        async_mode=async_mode.name if async_mode is not None else None, schedule=schedule.name, tp=request.mesh.tp,
        dp=request.mesh.dp, sharding=tuple(str(p) for p in request.sharding), seq_chunks=schedule.seq_chunks,
        precision=policy.name, recompute=bool(recompute_pairs(schedule, recompute)) or request.recompute != "none",
        clip_grad=options.get("clip_grad"), verify=bool(options.get("verify")), emulate=emulate is not None,
        checkpoint=checkpoint is not None, resume=resume, save_every=save_every,
        eval_every=options.get("eval_every") or 0, held_out=options.get("held_out"), dry_run=dry_run,
        save_hf=options.get("save_hf") is not None, sizes=tuple(sizes), model=choice.source,
        model_takes_chunks=spec.supports_sequence_chunks, model_has_tp_plan=spec.tp_plan is not None,
        model_tied=bool(spec.shape.tied), model_exports=spec.export is not None, async_forms=tuple(ASYNC_FORMS),
        split=request.costs.split is not None, vocab_parallel=vocab_parallel,
    )


def _resolve_split(request: ScheduleRequest, choice: ModelChoice, microbatch_size: int | None) -> ScheduleRequest:
    """`request` with --split auto replaced by the counts the simulator chooses for the run's
    own model (its shape, sequence and microbatch size) under the analytic model of
    --hardware (a preset, default a100, or a `pipeblocks calibrate` profile), within
    --gpu-memory when given (`resolve.build.choose_split_for`); other requests as they are."""
    if request.costs.split != AUTO:
        return request
    priced = CostSpec(shape=choice.shape, seq=choice.sequence, microbatch_size=microbatch_size or 1,
                      hardware=request.costs.hardware, split=AUTO, seq_split=request.costs.seq_split)
    chosen = choose_split_for(dataclasses.replace(request, costs=priced)).choice.counts
    return dataclasses.replace(request, costs=dataclasses.replace(request.costs, split=chosen))


def _check_fits(choice: ModelChoice, schedule: Schedule, tp: int,
                split: tuple[int, ...] | str | None = None) -> tuple[int, ...] | None:
    """The model's blocks fill the stages (by --split's counts when given: returned, checked),
    tensor parallelism divides its sizes, its context holds a sequence."""
    shape = choice.shape
    counts = None if split is None else check_split(split, layers=shape.layers, num_stages=schedule.num_stages,
                                                     p=schedule.p)
    layer_counts(shape.layers, schedule.num_stages // schedule.chains)  # DualPipe: the model's stages, once per chain
    check_tp(shape, tp, seq=choice.sequence)
    if shape.context is not None and choice.sequence > shape.context:
        raise ValueError(f"--seq {choice.sequence} is longer than the model's context of {shape.context} positions: "
                         f"use --seq {shape.context} or less")
    return counts


def load_data(data: DataSpec, choice: ModelChoice) -> TokenWindows:
    """The corpus in windows of the run's sequence, its ids checked against the model's vocabulary."""
    return load_corpus(data, seq=choice.sequence, vocab=choice.vocab, model_tokenizer=model_tokenizer(choice))


def model_tokenizer(choice: ModelChoice) -> str | None:
    """The model's own tokenizer: its --hf directory's (None for other models, and for a
    prediction of a config.json with no tokenizer beside it, which is priced on bytes)."""
    directory = choice.hf_directory
    if directory is None or (not choice.weights and not (Path(directory) / "tokenizer.json").is_file()):
        return None
    return directory


def _check_batch(cfg: TrainConfig, data: TokenWindows) -> None:
    if cfg.dp > 1 and cfg.global_batch_size > data.num_windows:
        s = cfg.schedule
        raise ValueError(
            f"--dp {cfg.dp}: a step takes dp x m x microbatch = {cfg.dp} x {s.m} x {cfg.microbatch_size} = "
            f"{cfg.global_batch_size} sequences but the data ({data.source}) holds only {data.num_windows} windows "
            f"of {cfg.model.sequence + 1} tokens: lower --dp, -m or --microbatch-size, or give more data (--data)"
        )


def run_lowering(cfg: TrainConfig) -> Lowering:
    """The settings the run's Program is lowered with, as its ranks run it: with data
    parallelism the mesh's policy per chunk, its replicas and a DP unit per block at block
    grain; the recomputed pairs, where the simulator placed them; under --vocab-parallel the
    vocabulary passes, placed by `vocab_setup.vocab_costs`."""
    s = cfg.schedule
    vocab = None
    if s.vocab_parallel:
        from .vocab_setup import vocab_costs  # torch: vocab_setup builds the rows' modules

        vocab = vocab_costs(cfg)
    if not cfg.data_parallel:
        return Lowering(recompute=s.recompute, recompute_at=s.recompute_anchors, vocab=vocab)
    return Lowering(tuple(cfg.sharding), cfg.dp, dp_units(cfg), s.recompute, s.recompute_anchors, vocab)


def dp_units(cfg: TrainConfig):
    """The DP units of every stage at the run's grain (None at chunk grain): one per block."""
    return units_for(cfg.mesh.dp_unit, cfg.stage_layers)


def run_program(cfg: TrainConfig) -> Program:
    """The Program every rank of the run runs (`runtime.PipelineRunner(program=)`), proved free
    of deadlock and well placed, as before a launch."""
    return run_lowering(cfg).program(cfg.schedule.schedule, check=True)
