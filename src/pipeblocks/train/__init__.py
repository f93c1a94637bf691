"""Training a model through a pipeline schedule: the built-in GPT and Llama, a user's
`ModelSpec` (`--model`) or a Hugging Face directory (`--hf`), on bytes, a tokenizer's tokens
or token files; synchronous schedules and the asynchronous modes (`asynchronous/`), with
data and tensor parallelism, vocabulary parallelism, checkpoints (atomic, verified on load,
saved on a stop), the single-process reference check (`--verify`), the dry run and the
measured-against-simulated report.

Names are imported on first use, so `from pipeblocks.train import TrainConfig` does not
import torch.
"""
from __future__ import annotations

from ..core.util.lazy import lazy_exports

__all__ = [
    "TrainConfig", "launch", "train_rank", "latest_step", "load_rank", "restore_rank", "save_rank",
    "TOLERANCE", "compare_grads", "reference_step", "RankResult", "build_report", "format_report",
]

_HOME = {
    "TrainConfig": "config", "launch": "loop", "train_rank": "loop",
    "latest_step": "checkpoint", "load_rank": "checkpoint", "restore_rank": "checkpoint", "save_rank": "checkpoint",
    "TOLERANCE": "reference", "compare_grads": "reference", "reference_step": "reference",
    "RankResult": "report", "build_report": "report", "format_report": "report",
}


__getattr__, __dir__ = lazy_exports(__name__, _HOME)
