"""Simulation front: the analytic transformer model, sequence splits, the text timeline and
plots (matplotlib only in `plots`). The cost model and event simulator live in the core
(the generators use them) and are re-exported here. No torch here."""
from ..core.cost.costs import Costs, StageCosts, parse_costs
from ..core.simulator.simulate import simulate, simulate_program
from ..core.simulator.timeline import Event, Timeline

__all__ = ["Costs", "StageCosts", "parse_costs", "simulate", "simulate_program", "Event", "Timeline"]
