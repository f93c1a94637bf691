"""`pipeblocks export NAME -p P -m M -o FILE`: write a schedule for another runtime or for
later (`--file`): torch.distributed.pipelining's compute-only CSV, its lowered CSV (with
sends, receives and the DP ops UNSHARD, RESHARD, REDUCE_GRAD), JSON, or the text form.

    pipeblocks export zb-v -p 4 -m 8 -o zbv.csv       # torch: _load_csv("zbv.csv", format="compute_only")
    pipeblocks export zb-v -p 4 -m 8 --dp 2 --sharding zero3 --format torch-comms-csv -o zbv_lowered.csv
                                                      # torch: _load_csv(..., format="compute_comms")
    pipeblocks simulate --file zbv.csv                # and back: CSV, JSON and text files load alike
    pipeblocks export --hf ckpt/ out/                 # a training checkpoint as a Hugging Face directory

`--hf CHECKPOINT_DIR OUT_DIR` writes the newest complete checkpoint of a `pipeblocks train
--checkpoint` directory (per-rank or data-parallel, at whatever p x dp x tp it was saved
with) as config.json, safetensors weights (sharded with an index above `--max-shard-gb`)
and the tokenizer's files, which `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..core.ir.errors import ScheduleError
from ..core.ir.schedule import write_atomically
from ..interop import program_to_torch_csv, to_torch_csv
from ..train.export_hf import export_checkpoint
from .common import add_schedule_options, build, request_from_args

_FORMATS = ("torch-csv", "torch-comms-csv", "json", "text")


def register(sub) -> None:
    parser = sub.add_parser("export", help="write a schedule as torch.distributed.pipelining CSV, JSON or text")
    add_schedule_options(parser, hf=False)  # --hf here is a checkpoint's export
    parser.add_argument("-o", "--output", default=None, help="output file (default: stdout)")
    parser.add_argument("--hf", nargs=2, default=None, metavar=("CHECKPOINT_DIR", "OUT_DIR"),
                        help="write a training checkpoint as a Hugging Face directory instead of a schedule")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, metavar="GB",
                        help="--hf: weights above this size are written in shards of at most this size (default 5)")
    parser.add_argument(
        "--format", choices=_FORMATS, default=None,
        help="default from the suffix: .csv torch-csv, .json json, otherwise the text form; "
        "torch-comms-csv: the lowered program (sends, receives, and DP ops for --dp/--sharding; torch has no "
        "recompute action, so a program with recomputation is refused)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.hf is not None:
        return _export_checkpoint(*args.hf, max_shard_gb=args.max_shard_gb)
    fmt = args.format or _format_of(args.output)
    if fmt == "torch-comms-csv" and args.dp_unit is None:
        args.dp_unit = "chunk"  # torch's lowered CSV has one DP op per stage, not per block
    built = build(request_from_args(args))
    schedule = built.schedule
    if built.costs.vocab is not None:
        raise ScheduleError(
            "export --vocab-parallel: torch's CSV and the schedule's text and JSON hold no vocabulary passes; "
            "`pipeblocks show --program --vocab-parallel` prints the Program with them"
        )
    if fmt == "torch-csv":
        body = to_torch_csv(schedule)
    elif fmt == "torch-comms-csv":
        body = program_to_torch_csv(built.program())
    elif fmt == "json":
        body = json.dumps(schedule.to_json(), indent=1) + "\n"
    else:
        body = schedule.to_text()
    if args.output:
        write_atomically(Path(args.output), body)
        print(f"wrote {args.output} ({fmt}, {schedule.name}, p={schedule.p}, m={schedule.m})", file=sys.stderr)
    else:
        sys.stdout.write(body)
    return 0


def _format_of(path: str | None) -> str:
    suffix = Path(path).suffix.lower() if path else ""
    return {".csv": "torch-csv", ".json": "json"}.get(suffix, "text")


def _export_checkpoint(checkpoint: str, out: str, *, max_shard_gb: float) -> int:
    if not max_shard_gb > 0:
        raise ValueError(f"--max-shard-gb {max_shard_gb}: give a size > 0")
    files = export_checkpoint(checkpoint, out, max_shard_bytes=int(max_shard_gb * 1e9))
    print(f"wrote {out}: config.json and {len(files)} safetensors file(s) from {checkpoint}", file=sys.stderr)
    return 0
