"""What `pipeblocks plan` prints: the ranked table, the JSON object, the launch commands."""
from __future__ import annotations

import shlex

from ..core.cost.split import split_text
from ..schedules import get

from .search import Evaluated, PlanResult

__all__ = ["table", "to_json", "commands", "row", "runnable", "trains", "TRAIN_RUNS_VOCAB_PARALLEL"]

_GB = 1e9

TRAIN_RUNS_VOCAB_PARALLEL = True
"""Whether `pipeblocks train --vocab-parallel` runs the vocabulary passes (it does: the built-in
Llama and --hf models, with data parallelism, without tensor parallelism; train.composition
refuses the rest). A plan whose best
candidate is a +vocab plan that `train` does not run also names the best plan it runs (`runnable`)."""


def trains(result: PlanResult, e: Evaluated) -> bool:
    """Whether `pipeblocks train` runs plan `e` as `commands` print it: a +vocab plan on the
    built-in Llama (`--model-family llama`) or a --hf model, without tensor parallelism or
    sequence chunks (any dp)."""
    c = e.candidate
    if not c.vocab_parallel:
        return True
    llama = result.problem.hf is not None or not result.problem.model.fused_qkv
    return TRAIN_RUNS_VOCAB_PARALLEL and llama and c.tp == 1 and c.seq_chunks == 1


def runnable(result: PlanResult) -> Evaluated | None:
    """The best feasible plan that `pipeblocks train` runs today (`trains`); None when there is none."""
    return next((e for e in result.ranked if trains(result, e)), None)


def row(e: Evaluated) -> dict:
    c = e.candidate
    return {
        "schedule": c.label, "dp": c.dp, "tp": c.tp, "pp": c.pp, "microbatch_size": c.microbatch_size, "m": c.m,
        "seq_chunks": c.seq_chunks, "vocab_parallel": c.vocab_parallel, "sharding": e.sharding, "mfu": e.mfu, "tokens_per_s": e.tokens_per_s,
        "iteration_time": e.iteration_time, "peak_memory": e.peak_memory, "static_memory": e.static_memory,
        "activation_memory": e.activation_memory, "bubble": e.bubble, "exposed_comm": e.exposed_comm,
        "simulated_m": list(e.simulated_m), "rank_memory": [list(x) for x in e.rank_memory],
    }


def table(result: PlanResult, top: int) -> str:
    """The `top` best feasible configurations, then the best of each schedule not among them."""
    capacity = result.problem.gpu_memory / _GB
    ranked = result.ranked
    shown = ranked[:top]
    extra = [e for e in result.best_per_schedule.values() if e not in shown]
    lines = [
        f"{'#':>3}  {'schedule':<18} {'dp':>2} {'tp':>2} {'pp':>3} {'mb':>3} {'m':>4}  {'sharding':<9} {'MFU':>6} "
        f"{'tokens/s':>9} {'iter s':>7} {'peak GB':>9} {'bubble':>6} {'exp. comm s':>11}"
    ]
    for index, e in [(ranked.index(e) + 1, e) for e in shown + extra]:
        c = e.candidate
        if e is (extra[0] if extra else None):
            lines.append("     (best of the other schedules)")
        lines.append(
            f"{index:>3}  {c.label:<18} {c.dp:>2} {c.tp:>2} {c.pp:>3} {c.microbatch_size:>3} {c.m:>4}  {e.sharding:<9} "
            f"{e.mfu * 100:5.2f}% {e.tokens_per_s:>9.0f} {e.iteration_time:>7.3f} "
            f"{e.peak_memory / _GB:>5.1f}/{capacity:<3.0f} {e.bubble * 100:5.1f}% {e.exposed_comm:>11.3f}"
        )
    return "\n".join(lines)


def to_json(result: PlanResult, top: int | None = None) -> dict:
    p = result.problem
    ranked = result.ranked
    return {
        "model": {"layers": p.model.layers, "hidden": p.model.hidden, "heads": p.model.heads, "seq": p.model.seq,
                  "vocab": p.model.vocab, "flash_attention": p.model.flash_attention, "dropout": p.model.dropout,
                  "shape": p.model.shape.to_json(), "params": p.model.shape.total_params(), "hf": p.hf},
        "precision": p.precision, "w_keeps": p.w_keeps, "dp_unit": p.dp_unit,
        "hardware": p.hardware.name, "gpus": p.gpus, "gpus_per_node": p.hardware.gpus_per_node,
        "gpu_memory": p.gpu_memory, "global_batch": p.global_batch,
        "best_per_schedule": {name: row(e) for name, e in result.best_per_schedule.items()},
        "ranked": [row(e) for e in (ranked if top is None else ranked[:top])],
        "simulations": result.simulations, "pruned_by_bound": result.pruned, "seconds": result.seconds,
        "commands": commands(result) if ranked else [],
        "train_commands": _train_commands(result),
    }


def _train_commands(result: PlanResult) -> list[str]:
    """The commands of the best plan `train` runs today (the same as "commands" unless the best is a
    +vocab plan that train does not run: `trains`)."""
    best = runnable(result)
    return [] if best is None else commands(result, best)


def commands(result: PlanResult, chosen: Evaluated | None = None) -> list[str]:
    """How to run the chosen plan: `pipeblocks train` (local processes), and the same run
    under torchrun. The model is the one the planner priced: a plan of `--hf DIR` names
    `--hf DIR --seq S --microbatch-size B` (the directory fixes the shape); otherwise the
    sizes `--layers --hidden --heads --seq`, and a tp > 1 plan of the GPT the model family
    (`--model-family gpt`); a Llama-shaped preset names `--model-family llama` (and
    `--kv-heads`), whose MLP width and vocabulary are then train's own. Tensor-parallel
    groups stay inside a node. `chosen`: another evaluated plan than the best."""
    e = result.ranked[0] if chosen is None else chosen
    p, c = result.problem, e.candidate
    model = p.model
    seq = f" --seq-chunks {c.seq_chunks}" if c.seq_chunks > 1 else ""
    # train's DP grain is block by default
    grain = f" --dp-unit {p.dp_unit}" if c.dp > 1 and p.dp_unit != "block" else ""
    mesh = f" --dp {c.dp} --sharding {e.sharding}{grain}" if c.dp > 1 else ""
    tp = f" --tp {c.tp}" if c.tp > 1 else ""
    ranks = c.dp * c.pp * c.tp
    # torchrun starts the same number of processes on every node; a tp group stays inside one
    per_node = max(d for d in range(1, p.hardware.gpus_per_node + 1) if ranks % d == 0 and d % c.tp == 0)
    nodes = ranks // per_node
    # the precision the memory was priced with (train's default is fp32)
    precision = f" --precision {p.precision}" if p.precision != "fp32" else ""
    if p.hf is not None:
        sizes = f"--hf {shlex.quote(p.hf)} --seq {model.seq} --microbatch-size {c.microbatch_size}"
        family = ""
    else:
        sizes = (f"--layers {model.layers} --hidden {model.hidden} --heads {model.heads} --seq {model.seq} "
                 f"--microbatch-size {c.microbatch_size}")
        if model.fused_qkv:
            family = " --model-family gpt" if c.tp > 1 else ""
        else:
            kv = model.shape.num_kv_heads
            family = " --model-family llama" + (f" --kv-heads {kv}" if kv != model.heads else "")
    vocab = " --vocab-parallel" if c.vocab_parallel else ""
    split = p.stage_split(get(c.schedule).num_stages(p=c.pp, m=c.m), c.vocab_parallel)
    vocab += f" --split {split_text(split)}" if split is not None else ""
    options = f" --schedule {c.schedule} -p {c.pp} -m {c.m}{mesh}{tp}{seq}{vocab} {sizes}{precision}{family}"
    # under torchrun `python -m pipeblocks train` runs the same run, one rank per process
    return [f"pipeblocks train{options}",
            f"torchrun --nnodes {nodes} --nproc-per-node {per_node} -m pipeblocks train{options}"]
