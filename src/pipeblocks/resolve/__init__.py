"""Resolving a run: a request (what the user typed, `request.ScheduleRequest`) becomes a
resolved run (costs, elastic groups, recompute pairs, sharding per chunk, DP units, the
layer split) in `build`, its Program lowered in one place (`program.Lowering`). The
choosers beside it (`elastic_plan`, `auto_sharding`, `recompute_auto`, `recompute_place`,
`split_auto`) call the simulator below them. Every command resolves through here, so what
is predicted, shown, exported and run is one Program. No torch here."""
