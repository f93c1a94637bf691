"""Peak memory of training data: a 1 GiB token file costs about what a 1 MiB one does.

    PYTHONPATH=src python benchmarks/data_memory.py                 # files in a temporary directory
    PYTHONPATH=src python benchmarks/data_memory.py --dir /scratch --json data_memory.json
    PYTHONPATH=src python benchmarks/data_memory.py --train         # whole `pipeblocks train` runs

With --train, each file is trained on by a real run instead (`pipeblocks train
--model-family llama --data FILE --vocab V -p 2`, --steps steps of m = 4 microbatches of
--batch / 4 sequences), and the peak is that of the largest process of the run (the
launcher or a rank: the run's RUSAGE_CHILDREN, measured in a fresh process per file).

Writes a large and a small uint16 token file (random ids below --vocab, the large one a
chunk at a time), then, in a fresh process for each so that each measures its own peak,
does what `pipeblocks train` does with one: `load_tokens` (the memory map, and the scan for
ids beyond the vocabulary), `split` off 5%, and draws --batches batches of --batch windows
of --seq tokens. Prints per file: its size, the process's peak resident memory
(ru_maxrss), the part of it already there after the imports, and the seconds to load and
check, and to draw the batches. The files are deleted afterwards.

Resident memory counts file pages mapped into the process too: the scan maps one chunk at a
time and drops it, and a batch touches only the pages of its windows.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _output import write_json

WRITE_CHUNK = 1 << 25
"""ids written at a time (64 MiB of uint16)"""


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(path: str, *, seq: int, batch: int, batches: int, vocab: int) -> dict:
    """In this process: load, check, split and draw; the peak and the times."""
    import torch

    from pipeblocks.data import load_tokens

    torch.set_num_threads(1)
    imported = _peak_mib()
    t0 = time.perf_counter()
    data = load_tokens(path, seq=seq, dtype="uint16", vocab=vocab)
    train, held = data.split(0.05)
    t1 = time.perf_counter()
    checksum = 0
    for step in range(batches):
        x, y = train.batch(step, batch, seed=0)
        checksum += int(x[:, 0].sum())
    x, y = held.eval_batch(batch)
    t2 = time.perf_counter()
    return {"file_bytes": os.path.getsize(path), "tokens": data.num_tokens, "tokens_kind": type(data.tokens).__name__,
            "peak_rss_mib": _peak_mib(), "after_imports_mib": imported, "load_check_s": t1 - t0,
            "batches_s": t2 - t1, "batches": batches, "batch": batch, "seq": seq, "checksum": checksum}


def train_peak(path: str, *, seq: int, batch: int, vocab: int, steps: int) -> dict:
    """In this process: one `pipeblocks train` run on `path`; the largest process's peak."""
    command = [sys.executable, "-m", "pipeblocks.cli.main", "train", "--model-family", "llama", "--layers", "4",
               "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--vocab", str(vocab), "--seq", str(seq),
               "--data", path, "-p", "2", "-m", "4", "--microbatch-size", str(max(1, batch // 4)),
               "--steps", str(steps), "--quiet"]
    t0 = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(run.stderr[-2000:])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"file_bytes": os.path.getsize(path), "peak_rss_mib": peak, "run_s": time.perf_counter() - t0,
            "steps": steps}


def write_token_file(path: Path, tokens: int, vocab: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "wb") as out:
        for start in range(0, tokens, WRITE_CHUNK):
            rng.integers(0, vocab, size=min(WRITE_CHUNK, tokens - start), dtype=np.uint16).tofile(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write the token files (default: a temporary directory)")
    parser.add_argument("--big-mib", type=int, default=1024)
    parser.add_argument("--small-mib", type=int, default=1)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON ('-': stdout)")
    parser.add_argument("--train", action="store_true", help="measure whole pipeblocks train runs on the files")
    parser.add_argument("--steps", type=int, default=20, help="--train: steps of each run (default 20)")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the child's mode
    parser.add_argument("--measure-train", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train and "--vocab" not in sys.argv:
        args.vocab = 512  # the trained model's vocabulary: a small head
    if args.train and "--seq" not in sys.argv:
        args.seq = 128
    sizes = {"seq": args.seq, "batch": args.batch, "batches": args.batches, "vocab": args.vocab}
    if args.measure:
        print(json.dumps(measure(args.measure, **sizes)))
        return
    if args.measure_train:
        print(json.dumps(train_peak(args.measure_train, seq=args.seq, batch=args.batch, vocab=args.vocab,
                                    steps=args.steps)))
        return
    if args.train:
        _train_table(args)
        return
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="data_memory_") as folder:
        rows = []
        for name, mib in (("small", args.small_mib), ("big", args.big_mib)):
            path = Path(folder) / f"{name}.bin"
            write_token_file(path, mib * 2**20 // 2, args.vocab, seed=len(rows))
            child = subprocess.run([sys.executable, __file__, "--measure", str(path),
                                    *[f"--{k}={v}" for k, v in sizes.items()]],
                                   check=True, capture_output=True, text=True)
            rows.append({"file": name, **json.loads(child.stdout.splitlines()[-1])})
            path.unlink()  # the big file goes as soon as it is measured
    print(f"{args.batches} batches of {args.batch} x {args.seq} tokens, 5% held out, vocabulary {args.vocab}; "
          "each file in its own process")
    print(f"{'file':>6s} {'size MiB':>9s} {'peak RSS MiB':>13s} {'after imports':>14s} {'load+check s':>13s} "
          f"{'batches s':>10s}")
    for row in rows:
        print(f"{row['file']:>6s} {row['file_bytes'] / 2**20:9.1f} {row['peak_rss_mib']:13.1f} "
              f"{row['after_imports_mib']:14.1f} {row['load_check_s']:13.3f} {row['batches_s']:10.3f}")
    if args.json:
        write_json({"rows": rows, **sizes}, args.json)


def _train_table(args) -> None:
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="data_memory_") as folder:
        rows = []
        for name, mib in (("small", args.small_mib), ("big", args.big_mib)):
            path = Path(folder) / f"{name}.bin"
            write_token_file(path, mib * 2**20 // 2, args.vocab, seed=len(rows))
            child = subprocess.run([sys.executable, __file__, "--measure-train", str(path), f"--seq={args.seq}",
                                    f"--batch={args.batch}", f"--vocab={args.vocab}", f"--steps={args.steps}"],
                                   check=True, capture_output=True, text=True)
            rows.append({"file": name, **json.loads(child.stdout.splitlines()[-1])})
            path.unlink()
    print(f"pipeblocks train, llama 4 x 64, vocabulary {args.vocab}, p=2, {args.steps} steps of {args.batch} x "
          f"{args.seq} tokens; each file in its own run")
    print(f"{'file':>6s} {'size MiB':>9s} {'peak RSS MiB (largest process)':>31s} {'run s':>7s}")
    for row in rows:
        print(f"{row['file']:>6s} {row['file_bytes'] / 2**20:9.1f} {row['peak_rss_mib']:31.1f} {row['run_s']:7.1f}")
    if args.json:
        write_json({"rows": rows, "train": True, "steps": args.steps, "seq": args.seq, "batch": args.batch,
                    "vocab": args.vocab}, args.json)


if __name__ == "__main__":
    main()
