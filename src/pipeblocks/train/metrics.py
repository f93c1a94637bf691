"""`--metrics FILE.jsonl`: one JSON object per line and step, for pandas and friends.

    >>> writer = MetricsWriter("run.jsonl", resume=False)   # a fresh run truncates the file
    >>> writer.write(step=1, loss=5.54, lr=3e-4, step_time_s=0.21, tokens=1024, rank=1,
    ...              activation_bytes=6_291_456, static_bytes=2_359_296)
    >>> import pandas; pandas.read_json("run.jsonl", lines=True)   # one row per step

Every line has the same keys (see `FIELDS`), null where a value does not apply:

    step              the optimizer step just done (1-based, as the progress lines count)
    loss              its training loss (the mean over its microbatches)
    lr                the learning rate it stepped with
    tokens_per_s      tokens of the step over its wall time
    step_time_s       the step's wall time on the rank that writes
    eval_loss         the held-out loss after this step (--eval-every), else null
    activation_bytes  the writing rank's peak saved-activation bytes in this step (null on
                      steps that do not count them)
    static_bytes      its parameter, gradient and optimizer-state bytes after the step
    device_max_bytes  torch.cuda.max_memory_allocated on a GPU, else null
    rank              the pipeline rank that writes (the one holding the last stage)
    time              seconds since the epoch

The rank that holds the last stage (of replica 0) writes, as it prints the progress lines;
a resumed run appends, so the file holds the whole run. Lines are flushed as written: a
run that stops early leaves every finished step in the file.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

__all__ = ["FIELDS", "MetricsWriter", "read_metrics"]

FIELDS = ("step", "loss", "lr", "tokens_per_s", "step_time_s", "eval_loss", "activation_bytes", "static_bytes",
          "device_max_bytes", "rank", "time")


class MetricsWriter:
    """Appends one line per step to `path` (created, or truncated unless `resume`)."""

    def __init__(self, path: str, *, resume: bool) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.path.open("a" if resume else "w", encoding="utf-8")

    def write(self, *, step: int, loss: float | None, lr: float, step_time_s: float, tokens: int, rank: int,
              eval_loss: float | None = None, activation_bytes: int | None = None, static_bytes: int | None = None,
              device_max_bytes: int | None = None) -> None:
        row = {
            "step": step, "loss": _finite(loss), "lr": lr,
            "tokens_per_s": tokens / step_time_s if step_time_s > 0 else None, "step_time_s": step_time_s,
            "eval_loss": _finite(eval_loss), "activation_bytes": activation_bytes, "static_bytes": static_bytes,
            "device_max_bytes": device_max_bytes, "rank": rank, "time": time.time(),
        }
        self._handle.write(json.dumps(row) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def read_metrics(path: str) -> list[dict]:
    """The lines of a metrics file, parsed (what `pandas.read_json(path, lines=True)` reads)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _finite(value: float | None) -> float | None:
    """JSON has no NaN or Infinity: a non-finite loss is written as null."""
    return value if value is not None and math.isfinite(value) else None
