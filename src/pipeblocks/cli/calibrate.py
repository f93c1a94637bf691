"""`pipeblocks calibrate`: measure this device's pass times and write the hardware profile
that `--hardware PROFILE.json` reads (simulate, compare, plot, plan, train --dry-run).

    pipeblocks calibrate -o cpu.json                              # the default grid, this CPU, fp32, as a rank of p=2
    pipeblocks calibrate --ranks 4 -o cpu-p4.json                 # as one of 4 local ranks (train -p 4, or -p 2 --dp 2)
    pipeblocks calibrate --device cuda --precision bf16-mixed -o h100.json
    pipeblocks calibrate --shapes 64x32x1,128x64x2 --no-links -o tiny.json --json

Per shape (HIDDENxSEQxMICROBATCH[xHEADS]) it times F, B and W of one block, the embedding
and the head with the runtime's own forward and split backward, counts their FLOPs, and
measures the block's saved bytes; it measures the peak (a large matmul's FLOP/s in the
precision: on a CPU there is no data-sheet figure to trust) and the memory bandwidth, and,
unless --no-links, the point-to-point and all-reduce latency and bandwidth between two
local processes (gloo on CPU, NCCL with two GPUs) and, on a CPU, how much longer the passes
take inside a pipelined run (a few steps of 1F1B and of v-half: `runtime.in_run`). Then it fits the achieved fraction of
the peak per pass kind, constant or as a function of arithmetic intensity, with or without
a fixed overhead per pass of a block, and says which fits best with the residuals
(`pipeblocks.sim.hardware_profile`). A shape that does not
fit in memory is skipped with a line saying so. Progress goes to stderr; the table (or,
with --json, the profile) to stdout.

On a CPU a pass takes as long as its torch threads make it, so calibrate times with the
threads a rank of the run will have: `pipeblocks train` gives each of its R local ranks
(p x dp x tp) the cores divided by R, at least one (`train.config.threads_per_rank`).
`--ranks R` times as one of R local ranks; its default is `train`'s default -p (2), so
that `calibrate` then `train --dry-run --hardware` with default options agree on every
machine. `--threads T` sets the threads directly; given with a --ranks that implies other
threads, it is an error. The profile records `threads` and `ranks`, and `train --dry-run
--hardware` warns when a rank of its run has other threads than the profile's.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path

from ..core.cost.precision import PRECISION_NAMES
from ..core.ir.schedule import write_atomically
from ..core.util.jsontext import json_text
from ..sim.analytic import TransformerConfig, layer_activation_bytes
from ..sim.hardware_profile import UNMEASURED_LINKS, build_profile, link_fields, profile_hardware
from ..train.config import TrainConfig, threads_per_rank
from ..train.predict import in_run_factors
from ..train.run import DEFAULT_P
from .argtypes import positive_int
from .common import print_json, progress

__all__ = ["register", "run", "parse_shapes", "calibration_threads", "DEFAULT_CPU_SHAPES", "DEFAULT_CUDA_SHAPES"]

DEFAULT_CPU_SHAPES = "64x64x2,64x128x4,128x64x2,128x128x4,256x64x2,256x128x4,512x64x2,512x128x4"
DEFAULT_CUDA_SHAPES = ("1024x1024x1x16,1024x2048x2x16,2048x1024x1x16,2048x2048x2x16,4096x1024x1x32,"
                       "4096x2048x1x32,8192x1024x1x64")


def calibration_threads(*, ranks: int | None, threads: int | None, cores: int) -> tuple[int, int | None]:
    """(torch threads to time with, local ranks they are a share of; None when --threads alone
    said): --threads when given, else one of `ranks` (default DEFAULT_P) ranks' share of `cores`.
    Both given and disagreeing is a ValueError naming the numbers."""
    if threads is None:
        ranks = DEFAULT_P if ranks is None else ranks
        return threads_per_rank(ranks, cores), ranks
    if ranks is not None and threads != threads_per_rank(ranks, cores):
        raise ValueError(f"--threads {threads} and --ranks {ranks} disagree: one of {ranks} local ranks on {cores} "
                         f"cores has {threads_per_rank(ranks, cores)} torch thread(s); give one of the two")
    return threads, ranks


def parse_shapes(text: str) -> list:
    """'HxSxB[xA],...' -> Shapes (heads by default: hidden / 128 for a hidden of 1024 or more that
    128 divides, else 4)."""
    from ..runtime.calibrate import Shape  # torch: the CLI's other commands must not import it

    shapes = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            values = [int(v) for v in item.lower().split("x")]
        except ValueError:
            values = []
        if len(values) not in (3, 4):
            raise ValueError(f"--shapes {item!r}: expected HIDDENxSEQxMICROBATCH[xHEADS], e.g. 128x64x2")
        hidden = values[0] if values else 0
        heads = values[3] if len(values) == 4 else (hidden // 128 if hidden >= 1024 and hidden % 128 == 0 else 4)
        shapes.append(Shape(values[0], values[1], values[2], heads))
    if not shapes:
        raise ValueError("--shapes: give at least one HIDDENxSEQxMICROBATCH[xHEADS]")
    return shapes


def register(sub) -> None:
    parser = sub.add_parser("calibrate", help="measure pass times on this device; write a hardware profile",
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("-o", "--output", required=True, metavar="PROFILE.json", help="where to write the profile")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto (default: CUDA when there is a GPU), cpu, cuda")
    parser.add_argument("--model-family", default="gpt", choices=("gpt", "llama"),
                        help="whose blocks to time (default gpt, the reference GPT)")
    parser.add_argument("--precision", default="fp32", choices=PRECISION_NAMES,
                        help="fp32 (default), fp64 or bf16-mixed (blocks computed in bfloat16)")
    parser.add_argument("--shapes", default=None, metavar="HxSxB[xA],...",
                        help=f"hidden x seq x microbatch [x heads] per point (default on CPU {DEFAULT_CPU_SHAPES}; "
                        f"on CUDA {DEFAULT_CUDA_SHAPES})")
    parser.add_argument("--ranks", type=positive_int, default=None, metavar="R",
                        help=f"on a CPU, time as one of R local ranks of a run (p x dp x tp) would: torch threads = "
                        f"cores // R, at least 1, as `pipeblocks train` gives its ranks (default {DEFAULT_P}, train's "
                        "default -p)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads on a CPU, instead of --ranks' share (an error beside a --ranks that "
                        "gives other threads)")
    parser.add_argument("--repeats", type=positive_int, default=7,
                        help="timed runs per shape; the fastest is kept, as other work only slows a pass (default 7)")
    parser.add_argument("--vocab", type=positive_int, default=256, help="vocabulary of the timed head (default 256)")
    parser.add_argument("--links", action=argparse.BooleanOptionalAction, default=True,
                        help="measure point-to-point and all-reduce between 2 local processes (default on; "
                        "--no-links writes an assumed link and says so)")
    parser.add_argument("--name", default=None, help="the profile's name (default: device, family, precision)")
    parser.add_argument("--json", action="store_true", help="print the profile as JSON instead of the table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..runtime.calibrate import resolve_device  # torch: the CLI's other commands must not import it

    device = resolve_device(args.device)
    shapes = parse_shapes(args.shapes or (DEFAULT_CUDA_SHAPES if device.type == "cuda" else DEFAULT_CPU_SHAPES))
    out = Path(args.output)
    if out.suffix.lower() != ".json":
        raise ValueError(f"-o {args.output!r}: a profile is JSON; give a name ending in .json")
    profile = calibrate(args, device, shapes)
    write_atomically(out, json_text(profile, indent=1) + "\n")
    if args.json:
        print_json(profile)
    else:
        print(format_profile(profile))
        print(f"profile  {out}   (use it as --hardware {out})")
    return 0


def calibrate(args: argparse.Namespace, device, shapes) -> dict:
    """Measure everything and build the profile document: on a CPU with the torch threads of
    `calibration_threads` (the caller's are restored after)."""
    from ..train.reference import torch_threads  # torch: the CLI's other commands must not import it

    if device.type != "cpu":  # a GPU's passes do not depend on the host's threads
        return _measure(args, device, shapes, ranks=None)
    cores = os.cpu_count() or 1
    threads, ranks = calibration_threads(ranks=args.ranks, threads=args.threads, cores=cores)
    progress(f"calibrate: {threads} torch thread(s) "
             f"({f'one of {ranks} local ranks' if ranks is not None else '--threads'} on {cores} cores)")
    with torch_threads(threads):
        return _measure(args, device, shapes, ranks=ranks)


def _measure(args: argparse.Namespace, device, shapes, *, ranks: int | None) -> dict:
    import torch  # the CLI's other commands must not import it

    from ..runtime import calibrate as measure

    started = time.monotonic()
    peak, peak_how = measure.peak_flops(args.precision, device)
    progress(f"calibrate: peak {peak / 1e9:.1f} GFLOP/s ({peak_how})")
    bandwidth, bandwidth_how = measure.memory_bandwidth(device)
    element = torch.empty((), dtype=measure.COMPUTE_DTYPES[args.precision]).element_size()
    points, skipped, notes = [], [], []
    for number, shape in enumerate(shapes, 1):
        need, free = measure.shape_bytes(shape, args.vocab, element), measure.available_memory(device)
        if need > 0.8 * free:
            reason = (f"needs about {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on {device.type}: skipped; "
                      "give smaller shapes")
            progress(f"calibrate: shape {shape.text}: {reason}")
            skipped.append({"shape": shape.text, "reason": reason})
            continue
        try:
            point = measure.measure_shape(args.model_family, shape, precision=args.precision, device=device,
                                          vocab=args.vocab, repeats=args.repeats)
        except torch.OutOfMemoryError:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            reason = f"out of memory on {device.type}: skipped; give smaller shapes"
            progress(f"calibrate: shape {shape.text}: {reason}")
            skipped.append({"shape": shape.text, "reason": reason})
            continue
        notes += [f"{shape.text}: {note}" for note in point.notes]
        block = point.parts["block"]
        progress(f"calibrate: shape {number}/{len(shapes)} {shape.text}: block F/B/W "
                 f"{block['F'].seconds * 1e3:.2f}/{block['B'].seconds * 1e3:.2f}/{block['W'].seconds * 1e3:.2f} ms "
                 f"({time.monotonic() - started:.0f} s)")
        points += _point_rows(args, point, element)
    links = None
    if args.links and device.type == "cuda" and torch.cuda.device_count() < 2:
        progress("calibrate: one GPU: no link between GPUs to measure; the profile's link is assumed (say so)")
        links = {**UNMEASURED_LINKS, "note": "not measured: one GPU (NCCL needs a GPU per rank); an assumed link"}
    elif args.links:
        progress("calibrate: links between 2 local processes ...")
        raw = measure.measure_links(device)
        links = {**link_fields(raw["p2p"], raw["all_reduce"], raw["ranks"]), "backend": raw["backend"]}
        if raw.get("between_passes") is not None:  # the runtime's own time around every pass
            links["between_passes_s"] = raw["between_passes"]
            progress(f"calibrate: the runtime takes {raw['between_passes'] * 1e3:.2f} ms between two passes")
    about = {
        "device": _device_about(device),
        "model_family": args.model_family, "precision": args.precision, "vocab": args.vocab,
        "threads": torch.get_num_threads() if device.type == "cpu" else None, "ranks": ranks,
        "torch": torch.__version__, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": "pipeblocks " + " ".join(sys.argv[1:]) if sys.argv and "pipeblocks" in sys.argv[0] else None,
        "memory_bandwidth_how": bandwidth_how, "skipped": skipped, "notes": notes,
    }
    name = args.name or f"{device.type}-{args.model_family}-{args.precision}"
    profile = build_profile(name=name, peak_flops=peak, peak_how=peak_how, points=points, links=links,
                            memory_bandwidth=bandwidth, about=about,
                            ranks_per_node=torch.cuda.device_count() if device.type == "cuda" else os.cpu_count() or 1)
    if args.links and device.type == "cpu" and points:
        # the first shape's block, with train's default microbatch: a run as `train` starts it
        shape = dataclasses.replace(shapes[0], microbatch=TrainConfig.microbatch_size)
        profile["in_run"] = _in_run(args, shape, profile)
    profile["seconds"] = time.monotonic() - started
    return profile


def _in_run(args, shape, profile: dict) -> dict:
    """The passes of a few 1F1B and v-half steps on two local processes against the profile's
    prediction for them (`runtime.in_run`): the in-run factor per chunks per rank."""
    import torch  # the CLI's other commands must not import it

    from ..runtime.in_run import IN_RUN_LAYERS, measure_in_run

    progress(f"calibrate: passes inside a run (1f1b and v-half, p=2, {IN_RUN_LAYERS} blocks of {shape.text}) ...")
    measured = measure_in_run(args.model_family, shape, precision=args.precision, threads=torch.get_num_threads())
    factors = in_run_factors(profile_hardware(profile), args.model_family, shape, args.precision, measured)
    progress("calibrate: inside a run the passes take " + ", ".join(
        f"{factor:.2f}x the profile's with {chunks} chunk(s) per rank" for chunks, factor in sorted(factors.items())))
    return {"factors": factors, "model": f"{args.model_family}, {IN_RUN_LAYERS} blocks of {shape.text}, p=2, m=8",
            "schedules": measured}


def _point_rows(args, point, element: int) -> list[dict]:
    """One row per (part, pass) of a measured shape; the block's F row carries its saved bytes
    and, for the GPT family, the analytic model's (sim.analytic.layer_activation_bytes)."""
    shape = point.shape
    rows = []
    for part, passes in point.parts.items():
        for kind, measure in passes.items():
            row = {"part": part, "pass": kind, "hidden": shape.hidden, "seq": shape.seq,
                   "microbatch": shape.microbatch, "heads": shape.heads, "seconds": measure.seconds,
                   "flops": measure.flops, "intensity": measure.intensity}
            if part == "block" and kind == "F":
                row["saved_bytes"] = point.saved_bytes
                row["kept_for_w_bytes"] = point.kept_for_w_bytes
                if args.model_family == "gpt":
                    row["saved_bytes_analytic"] = _analytic_saved(shape, args.vocab, element)
            rows.append(row)
    return rows


def _analytic_saved(shape, vocab: int, element: int) -> float:
    dtype = {2: "bf16", 4: "fp32", 8: "float64"}[element]
    config = TransformerConfig(layers=1, hidden=shape.hidden, heads=shape.heads, seq=shape.seq, vocab=vocab,
                               microbatch_size=shape.microbatch, dtype=dtype, flash_attention=True, dropout=False)
    return layer_activation_bytes(config, shape.seq, shape.seq)


def _device_about(device) -> dict:
    import torch  # the CLI's other commands must not import it

    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device), "count": torch.cuda.device_count()}
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            name = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), name)
    except OSError:
        pass
    return {"type": "cpu", "name": name, "cores": os.cpu_count()}


def format_profile(profile: dict) -> str:
    """The block points and the fits as a table."""
    peak = profile["peak"]["flops"]
    lines = [f"profile {profile['name']}: peak {peak / 1e9:,.1f} GFLOP/s ({profile['peak']['how']})",
             f"{'shape':>16} {'part':>9} {'pass':>4} {'ms':>9} {'GFLOP':>8} {'FLOP/B':>7} {'fraction':>8} "
             f"{'residual':>8}"]
    for x in profile["points"]:
        if x["part"] != "block" and not x["flops"]:
            continue
        shape = f"{x['hidden']}x{x['seq']}x{x['microbatch']}x{x['heads']}"
        fraction = "-" if x.get("fraction") is None else f"{x['fraction']:.3f}"
        residual = "-" if x.get("residual") is None else f"{x['residual']:+.3f}"
        lines.append(f"{shape:>16} {x['part']:>9} {x['pass']:>4} {x['seconds'] * 1e3:9.3f} {x['flops'] / 1e9:8.3f} "
                     f"{x['intensity']:7.1f} {fraction:>8} {residual:>8}")
    lines.append("fits (fraction of the peak; residuals are relative time errors over the block points):")
    for kind, fit in profile["fits"].items():
        c, r, o = fit["constant"], fit["roofline"], fit.get("roofline+overhead")
        with_overhead = "" if o is None else (
            f"; roofline {o['ceiling']:.3f} / (1 + {o['ridge']:.1f} / I) + {o['overhead_s'] * 1e6:.1f} us a block's "
            f"pass (rms {o['rms_residual']:.3f}, max {o['max_residual']:.3f})")
        lines.append(f"  {kind}: constant {c['ceiling']:.3f} (rms {c['rms_residual']:.3f}, max {c['max_residual']:.3f});"
                     f" roofline {r['ceiling']:.3f} / (1 + {r['ridge']:.1f} / I) (rms {r['rms_residual']:.3f}, max "
                     f"{r['max_residual']:.3f}){with_overhead}: {fit['chosen']} fits best")
    links = profile["links"]
    if links.get("measured"):
        p2p, ring = links["p2p"], links["all_reduce"]
        lines.append(f"links ({links.get('backend', '?')}, {ring['ranks']} processes): p2p {p2p['latency_s'] * 1e6:.1f} us + "
                     f"bytes / {p2p['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; all-reduce ring step "
                     f"{ring['latency_s'] * 1e6:.1f} us, {ring['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s")
    else:
        lines.append(f"links: {links.get('note', 'not measured')}")
    factors = profile.get("in_run", {}).get("factors")
    if factors:
        lines.append("inside a run (" + profile["in_run"]["model"] + "): the passes take " + ", ".join(
            f"{factor:.2f}x with {chunks} chunk(s) per rank" for chunks, factor in sorted(factors.items()))
            + " (train --dry-run --hardware applies it)")
    for item in profile.get("skipped", []):
        lines.append(f"skipped {item['shape']}: {item['reason']}")
    return "\n".join(lines)
