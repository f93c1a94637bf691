"""`train --vocab-parallel`: each rank's stages without the vocabulary layers, and its rows.

Under vocabulary parallelism (docs/vocab-parallel.md) the embedding and the head are split
by vocabulary rows over the p pipeline ranks, and no stage holds them: stage 0 starts at
the first block (its input is the all-reduced embedding output) and the last stage ends at
the final norm (its output X goes to every rank's S pass). For the built-in Llama at
p = 2 with V = 11 rows::

    rank 0: stage 0 = blocks 0..1          rows 0..5 of embed.weight and head.weight
    rank 1: stage 1 = blocks 2..3, norm    rows 6..10 (and one zero row of padding)

`strip_vocab(modules, spec)` rebuilds the stages without the vocabulary parts, and
`vocab_rank(...)` makes the rank's `runtime.vocab_step.VocabStep`: its shards of the tables
(filled from the run's seed as the whole model's are, or read from a Hugging Face
directory's weights; one shard when the head is tied to the embedding) as parameters for the optimizer, and the communication
(`runtime.vocab_link.DistVocabLink`) on the rank's pipeline. `full_tables` gathers the
shards back whole, by the model's names, for `--verify`.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..core.cost.costs import BlockCosts, Costs
from ..core.cost.dp_model import DPCostModel
from ..core.ir.vocab import VocabCosts
from ..models.stage import Stage
from ..runtime.vocab_emulate import VocabPassTimes
from ..runtime.vocab_link import DistVocabLink
from ..runtime.vocab_parallel import gather_rows, partition_vocab, shard_rows
from ..runtime.vocab_step import VocabStep

__all__ = ["emulated_pass_times", "full_tables", "strip_vocab", "vocab_costs", "vocab_paths", "vocab_rank"]


def vocab_paths(spec) -> tuple[str, str]:
    """(embedding path, head path) of the model's layout: the one module before the blocks,
    and the last one after them (after the final norm). Refused, named, for a layout that
    has another shape."""
    layout = spec.layout
    if len(layout.before) != 1 or len(layout.after) < 2:
        raise ValueError(
            f"--vocab-parallel: model {spec.name!r} has before={list(layout.before)} and after={list(layout.after)}; "
            "it needs one embedding before the blocks and a final norm then the head after them (Llama-style); "
            "drop --vocab-parallel"
        )
    return layout.before[0], layout.after[-1]


def strip_vocab(modules: Mapping[int, nn.Module], spec) -> dict[int, nn.Module]:
    """The stages of `modules` (global index -> Stage) rebuilt without the embedding and the
    head: the same block and norm modules (so the same parameters and names), no tie."""
    embed, head = vocab_paths(spec)
    out = {}
    for index, stage in modules.items():
        layout = stage.layout
        parts = {}
        for path in (*layout.before, *layout.after, *layout.shared):
            if path in (embed, head):
                continue
            try:
                parts[path] = stage.part(path)
            except KeyError:
                continue
        blocks = {int(name.rsplit(".", 1)[1]): block for name, block in stage.block_items()}
        out[index] = Stage(index=stage.index, num_stages=stage.num_stages, layers=stage.block_indices, layout=layout,
                           parts=parts, blocks=blocks, adapter=stage.adapter)
    return out


def _table(spec, path: str, *, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The whole [V, h] weight at `path` as the whole model of `seed` has it, or as the
    model's pretrained weights hold it."""
    shape = spec.shape
    if spec.weights is not None:
        return spec.weights.read(f"{path}.weight", (shape.vocab, shape.hidden)).to(device=device, dtype=dtype)
    table = torch.empty(shape.vocab, shape.hidden, dtype=dtype, device=device)
    spec.init(seed)(f"{path}.weight", table)
    return table


def vocab_rank(spec, *, rank: int, ranks: list[int], first: int, last: int, seed: int, master: torch.dtype,
               compute: torch.dtype, tokens: int, device, timeout_s: float, pipelines: list[list[int]] | None = None,
               before_pass=None):
    """Rank `rank`'s `VocabStep` on the pipeline of global `ranks` (pipeline order; `first` /
    `last`: the pipeline ranks of stage 0 and the last stage); `tokens` per microbatch.
    `pipelines`: every pipeline of the job, in one order on every process (the link's
    groups are made by all of them; default: this one only). `before_pass`: under --emulate,
    the `runtime.vocab_emulate.VocabPassTimes` each pass sleeps (`emulated_pass_times`)."""
    embed, head = vocab_paths(spec)
    p = len(ranks)
    part = partition_vocab(spec.shape.vocab, p)
    emb = nn.Parameter(shard_rows(_table(spec, embed, seed=seed, dtype=master, device=device), part, rank))
    out = emb if spec.shape.tied else nn.Parameter(
        shard_rows(_table(spec, head, seed=seed, dtype=master, device=device), part, rank))
    link = None
    for pipeline in pipelines or [ranks]:  # new_group is collective: every process makes every group
        made = DistVocabLink(pipeline, (tokens, spec.shape.hidden), compute, first=first, last=last, device=device)
        if list(pipeline) == list(ranks):
            link = made
        else:
            made.close()
    return VocabStep(rank, part, emb, out, link, first=first, last=last, dtype=compute, timeout_s=timeout_s,
                     before_pass=before_pass)


def emulated_pass_times(cfg):
    """Under --emulate F,B,W: what each vocabulary pass sleeps. `vocab_costs` prices the passes
    in layer forwards (one rank's share of a table against a layer's multiply-adds), so each
    unit lasts the F milliseconds of one layer."""
    return VocabPassTimes.from_costs(vocab_costs(cfg).vocab, ms_per_unit=cfg.emulation.times_ms[0])


def full_tables(spec, vocab, group) -> tuple[dict, dict]:
    """({name: whole gradient}, {name: whole weight}) of the vocabulary tables, gathered
    over the pipeline `group` from every rank's shard (every rank takes part)."""
    embed, head = vocab_paths(spec)
    names = [f"{embed}.weight"] if vocab.tables.tied else [f"{embed}.weight", f"{head}.weight"]
    grads, params = {}, {}
    world = dist.get_world_size(group)
    for name, shard in zip(names, vocab.parameters):
        for into, tensor in ((params, shard.detach()),
                             (grads, shard.grad if shard.grad is not None else torch.zeros_like(shard))):
            pieces = [torch.empty_like(tensor) for _ in range(world)]
            dist.all_gather(pieces, tensor.contiguous(), group=group)
            into[name] = gather_rows(pieces, vocab.part).cpu().clone()
    if vocab.tables.tied:  # the reference names the head's copy too
        grads[f"{head}.weight"] = grads[f"{embed}.weight"]
        params[f"{head}.weight"] = params[f"{embed}.weight"]
    return grads, params


def vocab_costs(cfg):
    """Costs with `vocab` set, for placing the passes into the Program: the stages' blocks
    against one rank's share of the tables (forward 2·n·h·V/p multiply-adds per table, against
    about 24·n·h² per layer), as unit times; the placement needs their order, not seconds.
    With --dp the blocks (one DP unit each at block grain) are priced as equal shares."""
    shape = cfg.model.spec().shape
    p = cfg.schedule.p
    layer = 24.0 * shape.hidden * shape.hidden
    vocab = 2.0 * shape.hidden * shape.vocab / p / layer
    layers = cfg.stage_layers
    per = sum(layers) / len(layers)
    f = tuple(n / per for n in layers)
    # data parallelism at block grain names each block's unit: the blocks as the stages hold them
    blocks = BlockCosts.even(tuple(layers), tuple(float(n) for n in layers))
    # one policy for all: the simulator prices the rows' own static bytes with the first
    # (core.simulator.vocab_sim.vocab_static); the placement needs the DP ops' order, not their bytes
    dp = DPCostModel(dp=cfg.dp, sharding=(cfg.sharding[0],), unit=cfg.mesh.dp_unit) if cfg.data_parallel \
        else DPCostModel()
    return Costs(t_f=f, t_b=f, t_w=f, params=tuple(float(n) for n in layers), blocks=blocks, data_parallel=dp,
                 vocab=VocabCosts(
        t_s=vocab, t_t=vocab, t_if=vocab / 10, t_ib=vocab / 10, t_bcast=0.05, t_c0=0.1, t_if_reduce=0.05,
        t_ib_bcast=0.05))
