"""Options shared by the schedule commands, and building a schedule from them.

A generator receives only the options it accepts (its keyword parameters); an option the
user gave that the schedule does not take is an error, not silently dropped.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys

from pathlib import Path

from ..core.errors import ScheduleError
from ..interop import from_torch_csv
from ..core.schedule import Schedule
from ..schedules import get
from ..schedules.sequence import split_sequence
from ..sim.analytic import HARDWARE, MODELS, parse_model, transformer_costs
from ..core.costs import Costs, parse_costs
from ..sim.sequence_split import SPLITS, chunk_shares, split_lengths

__all__ = ["add_schedule_options", "build_schedule", "costs_from_args", "print_json", "progress"]


def add_schedule_options(parser: argparse.ArgumentParser, *, name: bool = True) -> None:
    if name:
        parser.add_argument("name", help="schedule name (see `pipeblocks list`)")
    parser.add_argument("-p", type=int, default=4, help="pipeline ranks (default 4)")
    parser.add_argument("-m", type=int, default=8, help="microbatches per step (default 8)")
    parser.add_argument("-v", type=int, default=None, help="chunks per rank, for looped schedules (default 2)")
    parser.add_argument("--group-size", type=int, default=None, help="interleaved-1f1b: microbatches per group (p..m)")
    parser.add_argument(
        "--memory-limit", type=float, default=None,
        help="activation budget per rank, in peak_activation units (1F1B's peak is p)",
    )
    parser.add_argument(
        "--costs", default=None, metavar="TF,TB,TW[,TCOMM]",
        help="pass times per full stage (default 1,1,1,0); fused BW takes TB+TW",
    )
    parser.add_argument(
        "--mem-w-ratio", type=float, default=None, help="M_W/M_B: share of activation B keeps until W (default 1)"
    )
    parser.add_argument(
        "--model", default=None, metavar="PRESET|L,H,A,S[,V[,B]]",
        help=f"analytic transformer costs instead of unit costs (presets: {', '.join(MODELS)}); memory then in bytes",
    )
    parser.add_argument("--hardware", default="a100", choices=sorted(HARDWARE), help="hardware profile for --model")
    parser.add_argument(
        "--flash-attention", action="store_true", help="--model: attention that does not store the s x s scores"
    )
    parser.add_argument(
        "--seq-chunks", type=int, default=None, metavar="K",
        help="split every microbatch into K sequence chunks (Seq1F1B; composes with any schedule)",
    )
    parser.add_argument(
        "--seq-split", default="balanced", choices=SPLITS,
        help="sequence chunk boundaries: equal FLOPs under causal attention, or equal tokens (needs --model "
        "to differ; default balanced)",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="any other generator option, e.g. --set cost_aware=true (repeatable; see the schedule's docstring)",
    )
    parser.add_argument(
        "--file", default=None,
        help="load a schedule from a file instead of a name: .json, .csv (torch compute-only), or the text form",
    )


def costs_from_args(args: argparse.Namespace, schedule: Schedule | None = None) -> Costs:
    """Costs from --model (analytic, needs the schedule for its stage count), or --costs and
    --mem-w-ratio (unit costs by default)."""
    if args.model:
        if args.costs:
            raise ScheduleError("give either --model (analytic costs) or --costs, not both")
        if schedule is None:
            raise ScheduleError("--model needs the schedule's stage count")
        config = dataclasses.replace(parse_model(args.model), flash_attention=args.flash_attention)
        costs = transformer_costs(config, HARDWARE[args.hardware], num_stages=schedule.num_stages)
        if args.mem_w_ratio is not None:
            costs = dataclasses.replace(costs, mem_w_ratio=args.mem_w_ratio)
        if schedule.seq_chunks > 1:
            lengths = split_lengths(config.seq, schedule.seq_chunks, args.seq_split, config)
            seq_time, seq_mem = chunk_shares(lengths, config)
            costs = dataclasses.replace(costs, seq_time=seq_time, seq_mem=seq_mem)
        return costs
    base = parse_costs(args.costs) if args.costs else Costs()
    ratio = 1.0 if args.mem_w_ratio is None else args.mem_w_ratio
    return dataclasses.replace(base, mem_w_ratio=ratio)


# CLI option -> generator keyword
_OPTIONS = {"v": "v", "group_size": "group_size", "memory_limit": "memory_limit"}


def build_schedule(args: argparse.Namespace, name: str | None = None) -> Schedule:
    """The schedule the options describe: from --file, or by name through the registry;
    --seq-chunks composes sequence splitting with it."""
    if getattr(args, "file", None):
        return _load(args)
    spec = get(name or args.name)
    kwargs = _options(args, spec, {"p": args.p, "m": args.m})
    for item in getattr(args, "set", []):
        key, value = _parse_setting(item)
        if not spec.accepts(key):
            raise ScheduleError(f"schedule {spec.name!r} has no option {key!r}; it takes {sorted(spec.parameters)}")
        kwargs[key] = value
    k = getattr(args, "seq_chunks", None)
    build = spec if k is None else functools.partial(split_sequence, spec.name, seq_chunks=k)
    schedule = build(**kwargs)
    if spec.accepts("costs"):
        # Cost-aware generators: analytic costs depend on the stage count, which the first
        # build tells; the second build uses the real costs.
        schedule = build(**kwargs, costs=costs_from_args(args, schedule))
    return schedule


def _load(args: argparse.Namespace) -> Schedule:
    if Path(args.file).suffix.lower() == ".csv":
        try:
            text = Path(args.file).read_text()
        except OSError as err:
            raise ScheduleError(f"cannot read schedule file {args.file!r}: {err.strerror}") from None
        return from_torch_csv(text, m=None)
    return Schedule.load(args.file)


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
            return key.strip(), kind(text)
        except ValueError:
            pass
    return key.strip(), text.strip()


def _options(args: argparse.Namespace, spec, kwargs: dict[str, object]) -> dict[str, object]:
    for option, keyword in _OPTIONS.items():
        value = getattr(args, option, None)
        if value is None:
            continue
        if not spec.accepts(keyword):
            flag = "-" + option if len(option) == 1 else "--" + option.replace("_", "-")
            raise ScheduleError(f"schedule {spec.name!r} does not take {flag}; drop it or choose another schedule")
        kwargs[keyword] = value
    return kwargs


def print_json(data: object) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def progress(message: str) -> None:
    """Progress for long work goes to stderr, so stdout stays clean for tables and JSON."""
    print(message, file=sys.stderr, flush=True)
