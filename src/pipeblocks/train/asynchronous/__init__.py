"""Asynchronous pipeline training (PipeDream, PipeMare): `pipeblocks train --async MODE`.

    run.py         the launch, the checks before it, the printed summary and `--verify`
                   against the replay
    steps.py       the asynchronous step strategy of the training loop (train/loop.py):
                   resume, one Program per unit of the loop
    plan.py        the run as Programs: warm-up steps, asynchronous segments cut at drains
    drain.py       draining a running Program early on a stop request
    checkpoint.py  saving and resuming a drained run (weights, optimizers, the mode's state)
    report.py      `--report`: losses, delays, the steady state measured beside simulated
    stage.py       one stage's weights, optimizer and mode state (`AsyncStage`): what each
                   forward and backward computes with
    compute.py     the runtime's compute object that hands OPTIMIZER_STEP ops to the stages
    reference.py   the one-process replay of the same delays: the specification

What a mode is (no torch) lives in `pipeblocks.core.lowering.async_mode`, beside the weight versions
(`core.lowering.versions`) that define every microbatch's delay.
"""
