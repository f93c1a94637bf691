"""Pass times of a run's stages predicted from a hardware profile, for `train --dry-run
--hardware PROFILE.json`: what the profile says this device does, instead of timing here.

    >>> hardware = resolve_hardware("cpu.json")          # written by `pipeblocks calibrate`
    >>> f, b, w, t_comm = predicted_times(stages, tokens, loss_fn, targets, hardware, split=True)

Per stage and pass, the FLOPs of one microbatch are counted on the run's own stage modules
(`runtime.calibrate.count_stage_passes`, the counter `calibrate` measured with: matrix
products and fused attention) and divided by the peak times the profile's fraction for that
pass kind at the pass's arithmetic intensity, plus the profile's fixed overhead of that
pass kind (`fits.K.overhead_s`, seconds per pass of one block) times the stage's blocks,
and the embedding's and the head's own on the first and the last stage.
Stage 0 has no input gradient: its B counts nothing and its W the whole backward, priced at
the FLOP-weighted mean of the B and W fractions (half of a layer's backward FLOPs are
each's). A backward that runs as one pass (that W, and B and W under a schedule without a
split backward, `split=False`) pays the mean of B's and W's overheads once per block, not
both: `calibrate`'s stage 0, whose whole backward is one pass, takes less than its block's
B and W apart. A hop between ranks takes the profile's point-to-point latency plus the
activation's bytes over its bandwidth.

On a CPU a profile holds for the torch threads it was measured with (its `threads`): a
rank with other threads runs its passes at another speed (a profile timed with 2 threads
predicted p = 2 runs on 2 cores, 1 thread a rank, 29-37% short: docs/calibration).
`threads_mismatch` is the dry run's one-line warning for that, naming both numbers and the
`calibrate` option that fixes it.

A run also spends time of its own around every pass (the executor's work between two
passes of a rank: the train report's `between passes`). `calibrate` measures it on its two
link processes (`links.between_passes_s`), and the dry run adds it to every pass, as the
report's simulated side adds the measured one (`with_runtime_time`): on small models it is
a large share of the step (a fraction of a millisecond against passes of one or two).

A rank inside a run also computes its passes more slowly than the same passes timed alone,
and more so when it alternates between two stages (the V schedules): `calibrate` runs a few
steps of 1F1B and of v-half (`runtime.in_run`) and records, per chunks per rank, what the
run's passes took over what the profile predicts for them (`in_run_factors`, the profile's
`in_run` field). The dry run multiplies its predicted passes by the factor of the run's
chunks per rank (`profile_in_run_factor`; the two-chunk factor for more chunks).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Sequence

from .. import schedules
from .config import threads_per_rank

__all__ = ["in_run_factors", "predicted_times", "profile_between_passes", "profile_in_run_factor", "profile_threads",
           "threads_mismatch", "with_runtime_time"]


def predicted_times(stages: Sequence, inputs, loss_fn: Callable, target, hardware, *, split: bool = True) -> tuple[
        tuple[float, ...], tuple[float, ...], tuple[float, ...], float]:
    """(t_f, t_b, t_w per stage, t_comm) in seconds for one microbatch (module docstring);
    `split`: the schedule runs B and W apart (else the simulator's BW takes t_b + t_w)."""
    import torch  # torch is heavy: this module serves --dry-run, which profiles only when asked

    from ..runtime.calibrate import count_stage_passes

    counts = count_stage_passes(stages, inputs, loss_fn, target)
    peak = hardware.flops
    over_f, over_b, over_w = (hardware.overhead(kind) for kind in range(3))
    fused = (over_b + over_w) / 2  # one backward pass over a block (module docstring)

    def seconds(kind: int, count) -> float:
        return count.flops / (peak * hardware.fraction(kind, count.intensity)) if count.flops else 0.0

    def ends(kind: int, index: int) -> float:
        """The fixed time of the embedding (first stage) and the head (last stage) in pass `kind`."""
        return ((hardware.overhead(kind, "embedding") if index == 0 else 0.0)
                + (hardware.overhead(kind, "head") if index == len(counts) - 1 else 0.0))

    f, b, w = [], [], []
    for index, (cf, cb, cw) in enumerate(counts):
        blocks = len(getattr(stages[index], "block_indices", ()))
        f.append(seconds(0, cf) + blocks * over_f + ends(0, index))
        if index == 0 and not cb.flops:  # the whole backward runs in W
            mixed = 2.0 / (1.0 / hardware.fraction(1, cw.intensity) + 1.0 / hardware.fraction(2, cw.intensity))
            b.append(ends(1, index))
            w.append((cw.flops / (peak * mixed) if cw.flops else 0.0) + blocks * fused + ends(2, index))
        elif split:
            b.append(seconds(1, cb) + blocks * over_b + ends(1, index))
            w.append(seconds(2, cw) + blocks * over_w + ends(2, index))
        else:  # one BW pass: half the fused overhead on each side of t_b + t_w
            b.append(seconds(1, cb) + blocks * fused / 2 + ends(1, index))
            w.append(seconds(2, cw) + blocks * fused / 2 + ends(2, index))
    with torch.no_grad():
        activation = stages[0](inputs)
    leaves = [activation] if isinstance(activation, torch.Tensor) else list(activation)
    size = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
    t_comm = hardware.latency + size / hardware.bandwidth if len(stages) > 1 else 0.0
    return tuple(f), tuple(b), tuple(w), t_comm


def with_runtime_time(f: tuple[float, ...], b: tuple[float, ...], w: tuple[float, ...], between: float | None, *,
                      split: bool) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """The pass times with the runtime's time between passes added to each pass a rank runs:
    F, and B and W apart under a split backward (a stage's B only where it has one), else
    once to the fused backward (the simulator's BW takes t_b + t_w)."""
    if not between:
        return f, b, w
    f = tuple(t + between for t in f)
    if split:
        return f, tuple(t + between if t else t for t in b), tuple(t + between for t in w)
    return f, tuple(t + between for t in b), w


def in_run_factors(hardware, family: str, shape, precision: str, measured: dict) -> dict[str, float]:
    """{chunks per rank: the passes' measured time in a run over what `hardware` predicts for
    them} of `runtime.in_run.measure_in_run`'s result, summed over every pass of the step."""
    from ..runtime.in_run import in_run_model  # torch (the runtime): only with a calibrated profile

    factors = {}
    for name, run in measured.items():
        schedule = schedules.get(name)(p=2, m=2)
        spec, stages = in_run_model(family, shape, precision, schedule.num_stages)
        tokens = _tokens(shape)
        f, b, w, _ = predicted_times(stages, tokens[:, :-1], spec.loss, tokens[:, 1:], hardware,
                                     split=schedule.has_split_backward)
        each = {"F": f, "B": b, "W": w}
        predicted = sum(each[kind][int(stage)] if kind in each else b[int(stage)] + w[int(stage)]
                        for stage, kind in (_stage_kind(key) for key in run["passes"]))
        if predicted > 0:
            factors[str(run["chunks"])] = sum(run["passes"].values()) / predicted
    return factors


def _stage_kind(key: str) -> tuple[str, str]:
    """("12", "BW") of "12BW"."""
    digits = len(key) - len(key.lstrip("0123456789"))
    return key[:digits], key[digits:]


def _tokens(shape):
    """One microbatch of token ids ([microbatch, seq + 1]) for `shape`, seed 0."""
    import torch

    return torch.randint(0, 256, (shape.microbatch, shape.seq + 1), generator=torch.Generator().manual_seed(0))


def _profile_field(text: str, *keys: str):
    """The value at `keys` in the profile file `text` (None: a preset's name, no such file or
    field, or a file that is not a profile)."""
    path = Path(text)
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
        for key in keys:
            value = value.get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def profile_in_run_factor(text: str, chunks: int) -> float | None:
    """The in-run factor a profile file measured for `chunks` chunks per rank (the largest
    measured when it has none for that many; None: a preset, or not measured)."""
    factors = _profile_field(text, "in_run", "factors")
    if not isinstance(factors, dict):
        return None
    valid = {int(k): float(v) for k, v in factors.items() if str(k).isdigit() and _number(v) and v > 0}
    below = [k for k in valid if k <= chunks]
    return valid[max(below)] if below else None


def profile_between_passes(text: str) -> float | None:
    """The runtime's time between two passes a profile file measured (None: a preset, or not measured)."""
    value = _profile_field(text, "links", "between_passes_s")
    return float(value) if _number(value) and value >= 0 else None


def profile_threads(text: str) -> int | None:
    """The torch threads a profile file was measured with (None: a preset, or not said)."""
    threads = _profile_field(text, "threads")
    return threads if isinstance(threads, int) and not isinstance(threads, bool) else None


def threads_mismatch(hardware: str, *, threads: int, local_ranks: int, cores: int) -> str | None:
    """The warning when profile `hardware` was measured with other torch threads than the
    `threads` a rank of a run with `local_ranks` ranks on `cores` cores has (None: they agree,
    or the profile does not say)."""
    measured = profile_threads(hardware)
    if measured is None or measured == threads:
        return None
    share = threads_per_rank(local_ranks, cores)
    mine = (f"{threads} ({cores} cores // {local_ranks} local ranks)" if share == threads
            else f"{threads} (the run's threads per rank)")
    fix = (f"`pipeblocks calibrate --ranks {local_ranks}` (or `--threads {threads}`)" if share == threads
           else f"`pipeblocks calibrate --threads {threads}`")
    return (f"warning: hardware profile {hardware} was measured with {measured} torch thread(s), a rank of this run "
            f"has {mine}: its pass times are predicted for {measured}; recalibrate with {fix}")
