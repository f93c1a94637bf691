"""From a Schedule to a Program: structural validation, the lowering passes (sends and
receives, data-parallel ops, recomputation, optimizer steps, overlapped pairs, vocabulary
passes), the deadlock check, and `entry.lower_for`, the one entry every consumer uses."""
