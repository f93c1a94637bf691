"""Training the reference GPT through a pipeline schedule: loop, checkpoints, reference check."""
from .checkpoint import latest_step, load_rank, restore_rank, save_rank
from .reference import TOLERANCE, compare_grads, reference_step

__all__ = ["latest_step", "load_rank", "restore_rank", "save_rank", "TOLERANCE", "compare_grads", "reference_step"]
