"""Asynchronous pipeline training (PipeDream, PipeMare): `pipeblocks train --async MODE`.

    run.py        the launch, the rank body, the report and `--verify` against the replay
    stage.py      one stage's weights, optimizer and mode state (`AsyncStage`): what each
                  forward and backward computes with
    compute.py    the runtime's compute object that hands OPTIMIZER_STEP ops to the stages
    reference.py  the one-process replay of the same delays: the specification

What a mode is (no torch) lives in `pipeblocks.core.async_mode`, beside the weight versions
(`core.versions`) that define every microbatch's delay.
"""
