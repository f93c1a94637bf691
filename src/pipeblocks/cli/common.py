"""Options shared by the schedule commands, and the one request they build.

The options are declared in two groups: generator options (which schedule, p, m, its own
options, sequence chunks), read by every command including `train`, and cost options
(pass times or the analytic model), read by the commands that simulate without running.
`request_from_args` turns the parsed options into one `ScheduleRequest`; `build` (in
pipeblocks.resolve.build) turns that into the schedule and its costs, once.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from ..core.ir.dp_units import DP_UNIT_GRAINS
from ..core.ir.errors import ScheduleError
from ..core.cost.hf_config import supported_text
from ..core.util.jsontext import json_text
from ..resolve.request import RECOMPUTE_MODES, CostSpec, Mesh, ScheduleRequest
from ..core.ir.sharding import parse_sharding
from ..core.cost.split import AUTO, split_text
from ..sim.analytic import HF_SEQ, MODELS
from ..sim.hardware_profile import check_hardware_text, hardware_names_text
from ..resolve.build import Built, build, choose_split_for, stage_model_config
from ..resolve.split_auto import SplitChoice
from ..sim.sequence_split import SPLITS
from .argtypes import costs_text, positive_float, positive_int, setting_text, split_arg, unit_float

__all__ = [
    "add_generator_options", "add_mesh_options", "add_cost_options", "add_schedule_options", "request_from_args", "build", "Built",
    "json_text", "print_json", "progress", "analytic_costs", "build_split", "split_of", "split_lines",
]

# generator keyword <- CLI option (argparse dest)
_OPTIONS = ("v", "group_size", "memory_limit", "forward_groups", "backward_groups")


def add_generator_options(
    parser: argparse.ArgumentParser, *, name: str | None = "positional", p: int = 4, m: int = 8,
    name_help: str = "schedule name (see `pipeblocks list`)",
) -> None:
    """Which schedule and its generator options. `name`: "positional" (NAME), "option"
    (--schedule NAME, for `train`, whose default is chosen later) or None (`compare`)."""
    group = parser.add_argument_group("schedule")
    if name == "positional":
        group.add_argument("name", nargs="?", default=None, help=f"{name_help}; not needed with --file")
    elif name == "option":
        group.add_argument("--schedule", dest="name", default=None, help=name_help)
    group.add_argument("-p", type=positive_int, default=p, help=f"pipeline ranks (default {p})")
    group.add_argument("-m", type=positive_int, default=m, help=f"microbatches per step (default {m})")
    group.add_argument("-v", type=positive_int, default=None, help="chunks per rank, for looped schedules (default 2)")
    group.add_argument("--group-size", type=positive_int, default=None, help="interleaved-1f1b: microbatches per group (p..m)")
    group.add_argument(
        "--forward-groups", default=None, metavar="G1,G2,...",
        help="elastic: microbatches per forward group, summing to m (e.g. 8,4; default: from the costs)",
    )
    group.add_argument(
        "--backward-groups", default=None, metavar="G1,G2,...",
        help="elastic: microbatches per backward group, summing to m (e.g. 6,6; default: as --forward-groups)",
    )
    group.add_argument(
        "--recompute", default="none", choices=RECOMPUTE_MODES,
        help="recompute forwards before their backward: none, all (every stage and microbatch) or auto "
        "(the simulator picks pairs so static + activation memory fits --gpu-memory)",
    )
    group.add_argument(
        "--memory-limit", type=positive_float, default=None,
        help="activation budget per rank, in peak_activation units (1F1B's peak is p)",
    )
    group.add_argument(
        "--seq-chunks", type=positive_int, default=None, metavar="K",
        help="split every microbatch into K sequence chunks (Seq1F1B; composes with any schedule)",
    )
    group.add_argument(
        "--seq-split", default="balanced", choices=SPLITS,
        help="sequence chunk boundaries: equal FLOPs under causal attention, or equal tokens (default balanced)",
    )
    group.add_argument(
        "--split", default=None, type=split_arg, metavar="N1,N2,...|auto",
        help="transformer layers per stage, in stage order (p*v counts for looped and V schedules), e.g. 3,4,4,3; "
        "or auto: the simulator chooses them, embedding and head included, for the shortest step within "
        "--gpu-memory (default: even, the extra layers off the end stages)",
    )
    group.add_argument(
        "--vocab-parallel", action="store_true",
        help="vocabulary parallelism: the input embedding and the output layer (head and softmax cross entropy) "
        "split by vocabulary over all p ranks, their passes placed into the schedule (priced by --model or --hf)",
    )
    group.add_argument(
        "--set", action="append", default=[], type=setting_text, metavar="KEY=VALUE",
        help="any other generator option, e.g. --set cost_aware=true (repeatable; see the schedule's docstring)",
    )
    group.add_argument(
        "--file", default=None,
        help="load a schedule from a file instead of a name: .json, .csv (torch compute-only), or the text form",
    )
    add_mesh_options(parser)


def add_mesh_options(parser: argparse.ArgumentParser) -> None:
    """Data and tensor parallelism: replicas of the pipeline, sharding per chunk, the DP link, tp."""
    group = parser.add_argument_group("data parallel")
    group.add_argument("--dp", type=int, default=1, metavar="D", help="data-parallel replicas of the pipeline (default 1)")
    group.add_argument("--tp", type=int, default=1, metavar="T",
                       help="tensor-parallel ranks per stage (default 1): train runs them (p x dp x T processes); "
                       "with --model or --hf the simulator prices them (compute / T, the per-layer collectives, "
                       "a rank's memory)")
    group.add_argument(
        "--sharding", default="replicate", metavar="POLICY[,POLICY...]",
        help="per chunk (global stage), or one for all: replicate, zero1, zero2, zero3; or auto "
        "(the simulator picks per chunk: least step time, then least static memory, within --gpu-memory)",
    )
    group.add_argument(
        "--dp-bandwidth", type=float, default=None, metavar="GB/s",
        help="DP link bandwidth (default: the --hardware profile's; under unit costs, size units per time unit)",
    )
    group.add_argument(
        "--dp-latency", type=float, default=None, metavar="us",
        help="DP latency per ring step (default: the profile's; under unit costs, time units)",
    )
    group.add_argument(
        "--dp-unit", default=None, choices=DP_UNIT_GRAINS,
        help="grain of the DP collectives: block (the default: one gather and one reduction per block, pipelined "
        "with the passes, as FSDP2 per block and DDP buckets do) or chunk (one per chunk; the default of "
        "export --format torch-comms-csv, whose CSV has no unit)",
    )
    group.add_argument(
        "--gpu-memory", type=float, default=None, metavar="GB",
        help="--sharding auto, --recompute auto, elastic: memory per device for static memory plus peak activation "
        "(GB under --model or --hf; memory units under unit costs)",
    )
    group.add_argument(
        "--mixed-precision", action="store_true",
        help="static memory and collectives of bf16-mixed training (fp32 master, gradient and AdamW state plus a "
        "bf16 compute copy: 4+2+4+8 bytes per parameter; bf16 parameter gathers, fp32 gradient reductions) "
        "instead of fp32 AdamW's 4+4+8",
    )


def add_cost_options(parser: argparse.ArgumentParser, *, hf: bool = True) -> None:
    """Where the simulated costs come from: unit costs, --costs, or the analytic model of
    --model or --hf (a Hugging Face directory's config.json; `CostSpec.hf`), sized by --seq
    and --microbatch-size. hf=False leaves --hf to the command (`export --hf CHECKPOINT OUT`)."""
    group = parser.add_argument_group("costs")
    group.add_argument(
        "--costs", type=costs_text, default=None, metavar="TF,TB,TW[,TCOMM]",
        help="pass times per full stage (default 1,1,1,0); fused BW takes TB+TW",
    )
    group.add_argument(
        "--mem-w-ratio", type=unit_float, default=None, help="M_W/M_B: share of activation B keeps until W (default 1)"
    )
    source = group.add_mutually_exclusive_group()
    source.add_argument(
        "--model", default=None, metavar="PRESET|L,H,A,S[,V[,B]]",
        help=f"analytic transformer costs instead of unit costs (presets: {', '.join(MODELS)}); memory then in bytes",
    )
    if hf:
        source.add_argument(
            "--hf", default=None, metavar="DIR|config.json",
            help=f"analytic costs of a Hugging Face model, read from its config.json ({supported_text()}: "
            "grouped-query attention, head width, SwiGLU width, vocabulary, tied head); instead of --model",
        )
    group.add_argument(
        "--seq", type=positive_int, default=None, metavar="S",
        help="--model/--hf: tokens per sequence (default: the preset's; with --hf the model's context, at most "
        f"{HF_SEQ})",
    )
    group.add_argument(
        "--microbatch-size", type=positive_int, default=None, metavar="B",
        help="--model/--hf: sequences per microbatch (default: the preset's; with --hf 1)",
    )
    group.add_argument(
        "--hardware", default="a100", type=check_hardware_text, metavar="NAME|PROFILE.json",
        help=f"hardware for --model: a preset ({hardware_names_text()}; default a100) or a profile file written by "
        "`pipeblocks calibrate`",
    )
    group.add_argument(
        "--flash-attention", action="store_true",
        help="--model/--hf: attention that does not store the s x s scores (torch's scaled_dot_product_attention)"
    )


def analytic_costs(args: argparse.Namespace) -> bool:
    """The parsed cost options name the analytic model (--model or --hf): seconds and bytes."""
    return bool(getattr(args, "model", None) or getattr(args, "hf", None))


def add_schedule_options(parser: argparse.ArgumentParser, *, name: bool = True, hf: bool = True) -> None:
    """Generator and cost options: what `show`, `simulate`, `compare`, `plot` and `export` read."""
    add_generator_options(parser, name="positional" if name else None)
    add_cost_options(parser, hf=hf)


def request_from_args(
    args: argparse.Namespace, *, name: str | None = None, costs: CostSpec | None = None,
) -> ScheduleRequest:
    """The one request the parsed options describe. `costs` overrides the cost options
    (`train`, which has none: its costs come from --emulate or are unit costs)."""
    options: list[tuple[str, object]] = [(key, getattr(args, key)) for key in _OPTIONS if getattr(args, key) is not None]
    for item in args.set:
        key, value = _parse_setting(item)
        if any(key == given for given, _ in options):
            raise ScheduleError(f"--set {item!r}: option {key!r} is given twice; give it once")
        options.append((key, value))
    priced_here = costs is None  # train gives its own costs: its --tp is the runtime's
    link = {"dp_bandwidth": args.dp_bandwidth, "dp_latency": args.dp_latency, "mixed_precision": args.mixed_precision,
            "dp_unit": args.dp_unit or "block", "split": getattr(args, "split", None),
            "vocab_parallel": getattr(args, "vocab_parallel", False)}
    if costs is None:
        costs = CostSpec(
            times=args.costs, mem_w_ratio=args.mem_w_ratio, model=args.model, hardware=args.hardware,
            flash_attention=args.flash_attention, seq_split=args.seq_split, hf=getattr(args, "hf", None), seq=args.seq,
            microbatch_size=args.microbatch_size, **link,
        )
    else:
        costs = dataclasses.replace(costs, **link)
    tp = getattr(args, "tp", 1)
    if costs.split is not None and priced_here and not costs.analytic:
        raise ScheduleError(f"--split {split_text(costs.split) if isinstance(costs.split, tuple) else costs.split}: "
                            "layers per stage are priced by the analytic model: add --model NAME or --hf DIR "
                            "(unit costs and --costs are per stage and know no layers)")
    if tp > 1 and priced_here and not costs.analytic:
        raise ScheduleError(f"--tp {tp} is priced by the analytic model: add --model NAME or --hf DIR (and --hardware)")
    return ScheduleRequest(
        name=name or getattr(args, "name", None), m=args.m, mesh=Mesh(pp=args.p, dp=args.dp, tp=tp),
        options=tuple(options),
        seq_chunks=args.seq_chunks, costs=costs, file=args.file, gpu_memory=args.gpu_memory,
        recompute=getattr(args, "recompute", "none"),
        **_sharding(args.sharding),
    )


def build_split(request: ScheduleRequest) -> tuple[Built, SplitChoice | None]:
    """`build(request)`, with `--split auto` resolved first (`resolve.build.choose_split_for`) and
    its choice returned beside (None without --split auto), for the commands to print."""
    if request.costs.split == AUTO:
        chosen = choose_split_for(request)
        return build(chosen.request), chosen.choice
    return build(request), None


def split_of(built: Built) -> tuple[int, ...] | None:
    """Transformer layers per stage as the built request's analytic costs price them (None
    under unit costs and --costs, which know no layers)."""
    costs = built.request.costs
    if not costs.analytic:
        return None
    stages = built.schedule.num_stages
    return stage_model_config(costs, stages, p=built.request.p).stage_layers(stages)


def split_lines(built: Built, choice: SplitChoice | None, unit: str = " s") -> list[str]:
    """The split line(s) of `simulate`'s table: the counts, and --split auto's comparison."""
    counts = split_of(built)
    if counts is None:
        return []
    how = "given" if isinstance(built.request.costs.split, tuple) and choice is None else (
        "chosen" if choice is not None else "balanced per rank: no vocabulary layer on the end stages"
        if built.request.costs.vocab_parallel else "even")
    lines = [f"split         {split_text(counts)} layers per stage ({how})"]
    if choice is not None:
        lines.append(choice.describe(unit))
    return lines


def _sharding(text: str) -> dict[str, object]:
    if text.strip().lower() == "auto":
        return {"auto_sharding": True}
    return {"sharding": parse_sharding(text)}


def _parse_setting(item: str) -> tuple[str, object]:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ScheduleError(f"--set {item!r}: expected KEY=VALUE, e.g. --set cost_aware=true")
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return key.strip(), lowered == "true"
    if lowered in ("none", ""):
        return key.strip(), None
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        if not math.isfinite(value):
            raise ScheduleError(f"--set {item!r}: {key.strip()} must be a finite number, not {text.strip()!r}")
        return key.strip(), value
    return key.strip(), text.strip()


def print_json(data: object) -> None:
    """JSON without NaN or Infinity (see core.util.jsontext), so other tools can read it."""
    sys.stdout.write(json_text(data) + "\n")


def progress(message: str) -> None:
    """Progress for long work goes to stderr, so stdout stays clean for tables and JSON."""
    print(message, file=sys.stderr, flush=True)
