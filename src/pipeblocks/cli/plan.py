"""`pipeblocks plan`: choose dp x tp x pp, microbatch size, schedule and sharding for a model
on a cluster, by simulation, before the GPU hours are spent.

    pipeblocks plan --model 98.5b --gpus 40 --gpus-per-node 8 --hardware a100-80g --gpu-memory 80 \\
        --global-batch 160 --seq 1024
    pipeblocks plan --model 9.6b --gpus 16 --gpu-memory 80 --global-batch 64 --seq 2048 \\
        --schedules 1f1b,v-half,v-zb --json
    pipeblocks plan --hf path/to/Llama-3-8B --gpus 16 --gpu-memory 80 --global-batch 64 --seq 4096
    pipeblocks plan ... --plot plan.png --top 20

Prints the ranked configurations that fit (MFU, tokens/s, iteration time, peak memory per
GPU against capacity, bubble, exposed DP communication), the best of every schedule, and
the `pipeblocks train` / `torchrun` commands for the chosen plan. Progress goes to stderr.
See docs/planner.md for the model behind the numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ..core.ir.dp_units import DP_UNIT_GRAINS
from ..core.ir.errors import ScheduleError
from ..core.cost.hf_config import supported_text
from ..plan import PlanProblem, search
from ..plan.plot import plot_plan
from ..plan.report import commands, runnable, table, to_json
from ..plan.space import DEFAULT_MICROBATCH_SIZES, DEFAULT_SCHEDULES
from ..sim.analytic import HF_SEQ, MODELS, model_from_hf, parse_model
from ..sim.hardware_profile import check_hardware_text, hardware_names_text, resolve_hardware
from ..sim.memory_estimate import W_KEEPS
from .argtypes import plot_file, positive_float, positive_int, split_arg
from .common import print_json, progress

__all__ = ["register", "run"]


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers separated by commas, e.g. 1,2,4") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def register(sub) -> None:
    parser = sub.add_parser(
        "plan", help="search dp x tp x pp x microbatch x schedule x sharding by simulation; print the best plans",
        description=__doc__.split("\n\n")[0],
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="PRESET|L,H,A[,S[,V]]",
                        help=f"a preset ({', '.join(MODELS)}) or LAYERS,HIDDEN,HEADS,SEQ[,VOCAB] (a GPT)")
    source.add_argument("--hf", metavar="DIR|config.json",
                        help=f"a Hugging Face model directory or its config.json ({supported_text()}): its shape is "
                        "priced (grouped-query attention, head width, SwiGLU width, vocabulary, tied head) and the "
                        "printed commands name --hf DIR")
    parser.add_argument("--gpus", type=positive_int, required=True, help="GPUs in all")
    parser.add_argument("--gpus-per-node", type=positive_int, default=None,
                        help="GPUs sharing the intra-node link (default: the hardware profile's)")
    parser.add_argument("--hardware", default="a100-80g", type=check_hardware_text, metavar="NAME|PROFILE.json",
                        help=f"device and links: a preset ({hardware_names_text()}; default a100-80g) or a profile "
                        "file written by `pipeblocks calibrate`")
    parser.add_argument("--gpu-memory", type=positive_float, required=True, metavar="GB", help="memory per GPU")
    parser.add_argument("--global-batch", type=positive_int, required=True, help="sequences per optimizer step")
    parser.add_argument("--seq", type=positive_int, default=None,
                        help=f"tokens per sequence (default: the preset's; with --hf the model's context, at most "
                        f"{HF_SEQ})")
    parser.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES),
                        help=f"schedules to try, comma-separated (default {','.join(DEFAULT_SCHEDULES)})")
    parser.add_argument("--microbatch-sizes", type=_int_list, default=DEFAULT_MICROBATCH_SIZES, metavar="B1,B2,...",
                        help=f"microbatch sizes to try (default {','.join(map(str, DEFAULT_MICROBATCH_SIZES))})")
    parser.add_argument("--tp", type=_int_list, default=None, metavar="T1,T2,...",
                        help="tensor-parallel degrees allowed (default: every divisor of the GPUs per node)")
    parser.add_argument("--seq-chunks", type=_int_list, default=None, metavar="K1,K2,...",
                        help="also try every schedule split into K sequence chunks (Seq1F1B); 1: never split "
                        "(default: 2,4 for sequences of 8192 tokens or more, or when nothing fits whole)")
    flash = parser.add_mutually_exclusive_group()
    flash.add_argument("--flash-attention", dest="flash_attention", action="store_true", default=True,
                       help="attention that does not store the s x s scores, as Megatron-LM's flash attention and "
                       "torch's scaled_dot_product_attention (the default)")
    flash.add_argument("--no-flash-attention", dest="flash_attention", action="store_false",
                       help="attention that stores the s x s scores (5*a*s bytes per token and layer)")
    parser.add_argument("--intensity-model", choices=("on", "off"), default="on",
                        help="on (default): small GEMMs (few tokens per microbatch, narrow tensor-parallel shards) "
                        "reach less of the peak, by their arithmetic intensity against the profile's memory "
                        "bandwidth; off: one efficiency for every shape, the pass times of `simulate`")
    parser.add_argument("--fp32", action="store_true",
                        help="price training in fp32 (`train --precision fp32`): 4+4+8 bytes per parameter, fp32 "
                        "activations and DP traffic (default: bf16-mixed, fp32 master, gradient and AdamW state plus "
                        "a bf16 compute copy, 4+2+4+8, with bf16 activations)")
    parser.add_argument("--no-dropout", dest="dropout", action="store_false", default=None,
                        help="the model trains without dropout (no masks saved), as the reference GPT of "
                        "`pipeblocks train`; default: the model's (the GPT presets and sizes with dropout, "
                        "Megatron's accounting; the Llama and Qwen presets and --hf without)")
    parser.add_argument("--w-keeps", choices=W_KEEPS, default="graph",
                        help="what a split backward keeps from B until W: graph (default: pipeblocks' runtime, "
                        "all the forward saved but the loss) or weights (the Zero Bubble paper's M_W)")
    parser.add_argument("--dp-unit", choices=DP_UNIT_GRAINS, default="block",
                        help="the grain of the data-parallel collectives: block (default: a gather and a reduction "
                        "per layer, pipelined with the passes, as FSDP2 per block and DDP's buckets) or chunk (one "
                        "per chunk), as `train --dp-unit` runs them")
    parser.add_argument("--vocab-parallel", action="store_true",
                        help="also price every schedule with the input embedding and the head split by vocabulary "
                        "over the pipeline ranks (tp 1, whole sequences; listed as NAME+vocab), and rank both")
    parser.add_argument("--split", default=None, type=split_arg, metavar="N1,N2,...|auto",
                        help="transformer layers per stage: counts in stage order (only configurations with that many "
                        "stages), or auto (each configuration's stages balanced by pass time, the head and its loss "
                        "included; the train command printed names the split); default: even")
    parser.add_argument("--exhaustive", action="store_true",
                        help="simulate every configuration that can fit, not only those that can beat their "
                        "schedule's best (slower; a fuller plot)")
    parser.add_argument("--exact", action="store_true",
                        help="simulate every step at its own microbatch count (default: a step of more than 4 x pp "
                        "microbatches is timed on the line through simulations at 2 x pp and 4 x pp)")
    parser.add_argument("--jobs", type=positive_int, default=None, help="worker processes (default: up to 2)")
    parser.add_argument("--top", type=positive_int, default=10, help="rows of the ranked table (default 10; --json lists them all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=plot_file, default=None, metavar="FILE",
                        help="MFU against peak memory, one point per feasible configuration (.png, .svg)")
    parser.set_defaults(run=run)


def problem_from_args(args: argparse.Namespace) -> PlanProblem:
    if args.hf:
        model = model_from_hf(args.hf, seq=args.seq)
    else:  # LAYERS,HIDDEN,HEADS alone: a context of 1024 tokens
        model = parse_model(args.model + (",1024" if args.model.count(",") == 2 else ""))
    model = dataclasses.replace(
        model, seq=args.seq or model.seq, microbatch_size=1, flash_attention=args.flash_attention,
        dropout=model.dropout if args.dropout is None else args.dropout,
    )
    hardware = resolve_hardware(args.hardware)
    if args.gpus_per_node is not None:
        hardware = dataclasses.replace(hardware, gpus_per_node=args.gpus_per_node)
    schedules = tuple(x.strip() for x in args.schedules.split(",") if x.strip())
    return PlanProblem(
        model=model, hardware=hardware, gpus=args.gpus, gpu_memory=args.gpu_memory * 1e9,
        global_batch=args.global_batch, schedules=schedules, microbatch_sizes=args.microbatch_sizes,
        precision="fp32" if args.fp32 else "bf16-mixed", seq_chunks=args.seq_chunks, tp_degrees=args.tp,
        extrapolate=not args.exact, intensity=_intensity(args.intensity_model, hardware), w_keeps=args.w_keeps,
        dp_unit=args.dp_unit, hf=_hf_directory(args.hf) if args.hf else None, vocab_parallel=args.vocab_parallel,
        split=args.split,
    )


def _hf_directory(path: str) -> str:
    """The model directory `train --hf` takes: the directory of a config.json, else `path` as given."""
    given = Path(path)
    return str(given.parent) if given.name == "config.json" and given.is_file() else path


def _intensity(setting: str, hardware) -> bool:
    """The planner's intensity model, unless a calibrated profile's fits already carry the
    shape (they are fractions at the layer's intensity: applying the model again would
    count small GEMMs twice)."""
    if setting == "on" and hardware.passes is not None:
        progress(f"plan: --hardware {hardware.name} is a calibrated profile whose pass fractions depend on the "
                 "arithmetic intensity already: the intensity model is off")
        return False
    return setting == "on"


def run(args: argparse.Namespace) -> int:
    problem = problem_from_args(args)
    result = search(problem, jobs=args.jobs, exhaustive=args.exhaustive, progress=progress)
    if not result.ranked:
        least = result.least_memory_needed()
        hint = f"; the least any configuration needs is {least / 1e9:.1f} GB per GPU" if least else ""
        if result.seq_chunks != (1,):
            hint += f" (sequence chunks {','.join(map(str, result.seq_chunks[1:]))} tried too)"
        raise ScheduleError(
            f"no configuration of {problem.gpus} GPUs fits {problem.gpu_memory / 1e9:g} GB per GPU{hint}: "
            "raise --gpu-memory, add GPUs, or allow more schedules (1f1b-r, v-min) and smaller --microbatch-sizes"
        )
    if args.plot:
        plot_plan(result, args.plot)
    if args.json:
        print_json(to_json(result))
        return 0
    p = problem
    if p.model.fused_qkv and p.hf is None:  # the GPT: as it always read
        model = f"{p.model.layers} layers, hidden {p.model.hidden}, {p.model.heads} heads"
    else:
        model = (f"{p.model.shape.describe()}, {p.model.shape.total_params() / 1e9:.2f}B parameters"
                 + (f" (--hf {p.hf})" if p.hf else ""))
    print(f"plan: {model}, seq {p.model.seq}, "
          f"batch {p.global_batch} on {p.gpus} x {p.hardware.name} ({p.hardware.gpus_per_node} per node, "
          f"{p.gpu_memory / 1e9:g} GB)")
    print(table(result, args.top))
    print(f"{len(result.ranked)} configurations fit, {result.simulations} simulations, "
          f"{result.pruned} pruned by their MFU bound")
    if result.seq_chunks != (1,):
        print(f"sequence chunks tried: {','.join(map(str, result.seq_chunks))}")
    print("\nrun the best plan:")
    for line in commands(result):
        print(f"  {line}")
    other = runnable(result)
    if other is not None and other is not result.ranked[0]:
        print(f"\n`train --vocab-parallel` runs the built-in Llama and --hf models without --tp for now (simulate, "
              f"compare and plan place and price the rest); the best plan it runs is #{result.ranked.index(other) + 1}, "
              f"{other.candidate.label}:")
        for line in commands(result, other):
            print(f"  {line}")
    return 0
