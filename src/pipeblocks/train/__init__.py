"""Training the reference GPT through a pipeline schedule: config, loop, checkpoints,
the single-process reference check, and the measured-vs-simulated report.

Names are imported on first use, so `from pipeblocks.train import TrainConfig` does not
import torch.
"""
from __future__ import annotations

import importlib

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


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)
