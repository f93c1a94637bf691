"""The event simulator: a Program run under a cost model, one compute stream and one
data-parallel stream per rank, into a Timeline with its metrics (bubbles, peaks, steady
state)."""
