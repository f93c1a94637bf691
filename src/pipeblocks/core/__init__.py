"""The schedule core, torch-free, in four subpackages by idea:

- `ir`: the Schedule and the Program, their ops, placement and text form;
- `lowering`: validation and the passes that turn a Schedule into a Program;
- `cost`: how long passes take and how much memory a rank holds (costs, DP, TP, static memory);
- `simulator`: the event simulation of a Program and the metrics read off its Timeline;

and `util` (JSON text, lazy exports, loading a user's module). Generators (the schedules
layer) build on it; this module re-exports the names most callers want."""
from .ir.actions import Action, Kind, parse_actions
from .cost.costs import Costs, StageCosts, parse_costs
from .ir.errors import DeadlockError, ScheduleError
from .lowering.lower import PASSES, add_p2p, check_deadlock, lower
from .lowering.entry import lower_for
from .ir.ops import Comm, DPOp, OP_TYPES, Op, OpType, OptimizerStep, Stream, UnknownOpError
from .lowering.passes_dp import add_grad_reduce, add_sharding, check_dp_ops, dp_passes
from .ir.placement import Placement
from .ir.program import Program
from .ir.schedule import Schedule
from .ir.sharding import ShardingPolicy, parse_sharding, per_stage
from .simulator.simulate import simulate, simulate_program
from .simulator.steady import SteadyState, steady_state
from .lowering.steps import add_optimizer_steps, check_optimizer_steps
from .simulator.timeline import Event, Timeline
from .lowering.validate import check_program, check_structure, validate
from .lowering.versions import WeightVersions, stashed_versions, weight_versions

__all__ = [
    "Action", "Kind", "parse_actions", "DeadlockError", "ScheduleError", "check_deadlock", "lower", "lower_for",
    "Placement", "Comm", "Op", "Program", "Schedule", "check_structure", "validate", "Costs", "StageCosts",
    "parse_costs", "simulate", "simulate_program", "Event", "Timeline", "PASSES", "add_p2p", "OP_TYPES", "OpType",
    "Stream", "UnknownOpError", "DPOp", "add_grad_reduce", "add_sharding",
    "check_dp_ops", "dp_passes", "ShardingPolicy", "parse_sharding", "per_stage",
    "OptimizerStep", "add_optimizer_steps", "check_optimizer_steps", "check_program", "SteadyState", "steady_state",
    "WeightVersions", "weight_versions", "stashed_versions",
]
