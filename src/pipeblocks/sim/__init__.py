"""Cost model, event simulator, metrics and plots. No torch here."""
from .costs import Costs, StageCosts, parse_costs
from .simulator import simulate, simulate_program
from .timeline import Event, Timeline

__all__ = ["Costs", "StageCosts", "parse_costs", "simulate", "simulate_program", "Event", "Timeline"]
