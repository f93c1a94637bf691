"""The hybrid-parallel planner: choose dp x tp x pp, the microbatch size, the schedule and
its sharding for a model, a cluster and a memory budget, by simulation (`pipeblocks plan`)."""
from .search import Candidate, Evaluated, PlanResult, Skipped, search
from .space import DEFAULT_SCHEDULES, MeshShape, PlanProblem

__all__ = ["Candidate", "DEFAULT_SCHEDULES", "Evaluated", "MeshShape", "PlanProblem", "PlanResult", "Skipped", "search"]
