"""The schedule core: IR, text form, placement, validation, lowering, the cost model and
the event simulator. No torch here; generators (the schedules layer) build on it."""
from .actions import Action, Kind, parse_actions
from .costs import Costs, StageCosts, parse_costs
from .errors import DeadlockError, ScheduleError
from .lower import PASSES, add_p2p, check_deadlock, lower
from .lowering import lower_for
from .ops import OP_TYPES, OpType, Stream, UnknownOpError
from .passes_dp import add_grad_reduce, add_sharding, check_dp_ops, dp_passes
from .placement import Placement
from .program import Comm, DPOp, Op, OptimizerStep, Program
from .request import CostSpec, Mesh, ScheduleRequest
from .schedule import Schedule
from .sharding import ShardingPolicy, parse_sharding, per_stage
from .simulate import simulate, simulate_program
from .steady import SteadyState, steady_state
from .steps import add_optimizer_steps, check_optimizer_steps
from .timeline import Event, Timeline
from .validate import check_program, check_structure, validate
from .versions import WeightVersions, stashed_versions, weight_versions

__all__ = [
    "Action", "Kind", "parse_actions", "DeadlockError", "ScheduleError", "check_deadlock", "lower", "lower_for",
    "Placement", "Comm", "Op", "Program", "Schedule", "check_structure", "validate", "Costs", "StageCosts",
    "parse_costs", "simulate", "simulate_program", "Event", "Timeline", "PASSES", "add_p2p", "OP_TYPES", "OpType",
    "Stream", "UnknownOpError", "CostSpec", "Mesh", "ScheduleRequest", "DPOp", "add_grad_reduce", "add_sharding",
    "check_dp_ops", "dp_passes", "ShardingPolicy", "parse_sharding", "per_stage",
    "OptimizerStep", "add_optimizer_steps", "check_optimizer_steps", "check_program", "SteadyState", "steady_state",
    "WeightVersions", "weight_versions", "stashed_versions",
]
