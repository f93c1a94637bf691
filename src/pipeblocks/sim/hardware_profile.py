"""Hardware profiles measured by `pipeblocks calibrate`: the fit, the file, and the lookup
that lets every `--hardware` take a preset name or a profile file.

    >>> hardware = resolve_hardware("a100")                 # a built-in preset (sim.analytic.HARDWARE)
    >>> hardware = resolve_hardware("cpu.json")             # a profile written by `pipeblocks calibrate`
    >>> fit = fit_fraction([(intensity, fraction, seconds), ...])  # the three fits, and which is best

A profile is JSON (FORMAT below). What the simulator and the planner read from it:

    peak.flops                   FLOP/s taken as the peak (on a CPU: a large matmul's, measured)
    fits.F|B|W.chosen            "constant", "roofline" or "roofline+overhead"; the chosen
                                 fit's ceiling and ridge give the pass's fraction of the peak
                                 at intensity I: ceiling / (1 + ridge / I) (ridge 0 under
                                 "constant"), and its overhead_s the fixed seconds one pass
                                 of one block adds (0 but under "roofline+overhead"; a
                                 profile without the field has none)
    fits.F|B|W.embedding_overhead_s, .head_overhead_s
                                 the fixed seconds the first stage's embedding and the last
                                 stage's head (with the loss) add to that pass beyond their
                                 FLOPs' time at the chosen fraction (absent: none)
    efficiency                   one fraction for consumers that take one (FLOP-weighted over
                                 the passes' points)
    links.p2p                    latency_s, bandwidth_bytes_per_s of one pipeline hop
    links.all_reduce             latency_s, bandwidth_bytes_per_s of a ring step (data parallel)
    memory_bandwidth_bytes_per_s the device memory's, or null
    ranks_per_node               devices (or processes) sharing the measured links

and `points` holds every measured pass (part, shape, seconds, FLOPs, intensity, fraction),
which the fits came from. A file that is not such a profile, or holds a field that is not
a finite number in range, is refused in one line naming the file and the field.

The fit. For each pass kind the points are (I, f, t) with f = FLOPs / (t * peak), t a
block's pass time. Constant: f = c. Roofline: f = c / (1 + R / I), with c <= 1. Roofline
plus overhead: time = FLOPs / (peak * c / (1 + R / I)) + t0, t0 >= 0 seconds per pass of a
block: the fixed cost of launching its operators, which a pass under a millisecond (a
small block on a CPU) spends a large share of and a GPU's millisecond passes hardly any.
All three are fitted by least squares on the relative error of the predicted time
(t_pred / t - 1 = f * (1 + R / I) / c + t0 / t - 1: for a given R, 1/c and t0 in closed
form; R >= 0 by a search), so the residuals are relative time errors. Each form has one
parameter more than the one before it and is chosen only when its root-mean-square residual
is at least 10% below the form chosen without it (ROOFLINE_GAIN, OVERHEAD_GAIN); for the
overhead both are first scaled by sqrt(n / (n - parameters)) (the residual standard error;
at least 4 points), so that a third parameter is not chosen for fitting a few points' noise;
and a richer form must lower the residual by more than rounding (RESIDUAL_FLOOR).

The end parts. The embedding (no FLOPs counted: a lookup) and the head are timed too, as
their stage less a block; with the block's chosen fraction fixed, each part's fixed time
per pass kind is the least-squares t0 >= 0 of the same relative residuals,
(FLOPs / (peak * f(I)) + t0) / t - 1 (closed form). Without it the embedding's passes were
priced at nothing, and the head's were 10-60% short on a CPU. A part timed as 0 at some
shape (the stage took less than its block) gets none: the embedding's W, which is stage
0's whole backward in one pass, cheaper than a block's B and W apart.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..core.ir.errors import ScheduleError
from .analytic import HARDWARE, Hardware, PassEfficiency

__all__ = [
    "FORMAT", "PASS_KINDS", "Fit", "FractionFit", "fit_fraction", "ROOFLINE_GAIN", "OVERHEAD_GAIN", "OVERHEAD_FORM",
    "END_PARTS", "fit_part_overhead", "load_profile", "profile_hardware",
    "resolve_hardware", "hardware_names_text", "is_profile_path", "check_hardware_text", "fit_link", "link_fields",
    "build_profile", "UNMEASURED_LINKS",
]

FORMAT = "pipeblocks-hardware-profile/1"
PASS_KINDS = ("F", "B", "W")
ROOFLINE_GAIN = 0.9
"""The roofline is chosen when its RMS residual is below this share of the constant's."""
OVERHEAD_GAIN = 0.9
"""The roofline plus overhead is chosen when its residual standard error is below this
share of the form's chosen between the constant and the roofline."""
OVERHEAD_FORM = "roofline+overhead"
RESIDUAL_FLOOR = 1e-6
"""A form must lower the RMS residual by more than this too: below it residuals are rounding."""
END_PARTS = ("embedding", "head")
"""The parts besides the blocks that `calibrate` times, whose fixed time per pass is fitted too."""


@dataclass(frozen=True)
class Fit:
    """One form's fit: ceiling, ridge (0 for a constant), overhead (seconds per pass of a
    block; 0 but for the roofline plus overhead), and its relative time residuals."""

    form: str
    ceiling: float
    ridge: float
    rms_residual: float
    max_residual: float
    overhead_s: float = 0.0

    def efficiency(self) -> PassEfficiency:
        return PassEfficiency(self.ceiling, self.ridge, self.overhead_s)

    def to_json(self) -> dict:
        return {"form": self.form, "ceiling": self.ceiling, "ridge": self.ridge, "overhead_s": self.overhead_s,
                "rms_residual": self.rms_residual, "max_residual": self.max_residual}


@dataclass(frozen=True)
class FractionFit:
    """The fits of one pass kind and the one chosen; `overhead` is None when the points had
    no seconds to fit it with."""

    constant: Fit
    roofline: Fit
    chosen: str
    overhead: Fit | None = None

    @property
    def best(self) -> Fit:
        if self.chosen == OVERHEAD_FORM and self.overhead is not None:
            return self.overhead
        return self.roofline if self.chosen == "roofline" else self.constant

    def to_json(self) -> dict:
        best = self.best
        fits = {"constant": self.constant.to_json(), "roofline": self.roofline.to_json()}
        if self.overhead is not None:
            fits[OVERHEAD_FORM] = self.overhead.to_json()
        return {"chosen": self.chosen, "ceiling": best.ceiling, "ridge": best.ridge, "overhead_s": best.overhead_s,
                **fits}


Point = tuple[float, float, float]  # intensity, fraction, seconds (0: not known)


def _fit(form: str, points: Sequence[Point], alpha: float, beta: float, t0: float = 0.0) -> Fit:
    res = [f * (alpha + beta / i) + (t0 / t if t0 else 0.0) - 1.0 for i, f, t in points]
    return Fit(form, 1.0 / alpha, beta / alpha, math.sqrt(sum(r * r for r in res) / len(res)),
               max(abs(r) for r in res), t0)


def _best_ceiling(points: Sequence[Point], ridge: float) -> Fit:
    """For a fixed ridge R, the least-squares 1/c (closed form, the ceiling at most 1: no
    more than the peak) and its residuals."""
    g = [f * (1.0 + ridge / i) for i, f, _ in points]
    alpha = max(1.0, sum(g) / sum(x * x for x in g))
    return _fit("roofline" if ridge > 0 else "constant", points, alpha, alpha * ridge)


def _best_ceiling_and_overhead(points: Sequence[Point], ridge: float) -> Fit:
    """For a fixed ridge R, the least-squares 1/c >= 1 and t0 >= 0 of the residuals
    a * g + t0 * u - 1 (g = f * (1 + R / I), u = 1 / t): the 2 x 2 normal equations, or,
    where their solution leaves the box, the better of its two edges."""
    g = [f * (1.0 + ridge / i) for i, f, _ in points]
    u = [1.0 / t for _, _, t in points]
    sgg, suu, sgu = sum(x * x for x in g), sum(x * x for x in u), sum(x * y for x, y in zip(g, u))
    sg, su = sum(g), sum(u)
    det = sgg * suu - sgu * sgu
    candidates = []
    if det > 1e-12 * sgg * suu:
        alpha, t0 = (sg * suu - su * sgu) / det, (sgg * su - sgu * sg) / det
        if alpha >= 1.0 and t0 >= 0.0:
            candidates.append((alpha, t0))
    if not candidates:  # an edge: a = 1 (t0 free, at least 0), or t0 = 0 (a free, at least 1)
        candidates.append((1.0, max(0.0, (su - sgu) / suu)))
        candidates.append((max(1.0, sg / sgg), 0.0))
    fits = [_fit(OVERHEAD_FORM, points, a, a * ridge, t0) for a, t0 in candidates]
    return min(fits, key=lambda fit: fit.rms_residual)


def _search_ridge(points: Sequence[Point], fit_at) -> Fit:
    """The ridge R > 0 whose fit (`fit_at(points, R)`) has the least RMS residual: a
    logarithmic grid, then a golden-section search between the best grid point's neighbours."""
    top = max(i for i, _, _ in points)
    grid = [top * 10 ** (k / 50) for k in range(-300, 151)]  # R from 1e-6 to 1e3 times the largest intensity
    best = min((fit_at(points, r) for r in grid), key=lambda fit: fit.rms_residual)
    lo, hi = math.log(best.ridge) - math.log(10) / 50, math.log(best.ridge) + math.log(10) / 50
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if fit_at(points, math.exp(a)).rms_residual < fit_at(points, math.exp(b)).rms_residual:
            hi = b
        else:
            lo = a
    return min(best, fit_at(points, math.exp((lo + hi) / 2)), key=lambda fit: fit.rms_residual)


def _scaled(fit: Fit, factor: float) -> Fit:
    return Fit(fit.form, fit.ceiling, fit.ridge, fit.rms_residual * factor, fit.max_residual, fit.overhead_s)


def _better(richer: Fit, simpler: Fit, gain: float) -> bool:
    """Whether the form with a parameter more fits clearly better: its RMS residual below
    `gain` times the simpler's, and lower by more than rounding (RESIDUAL_FLOOR)."""
    return (richer.rms_residual < gain * simpler.rms_residual
            and simpler.rms_residual - richer.rms_residual > RESIDUAL_FLOOR)


def fit_fraction(points: Sequence[tuple[float, ...]]) -> FractionFit:
    """Fit (intensity, fraction[, seconds]) points with a constant, the roofline form and,
    when every point has its seconds, the roofline plus a fixed time per pass (see the module
    docstring); intensities, fractions and seconds must be > 0. The ridge R >= 0 is searched
    on a logarithmic grid, then by golden section around the best, the ceiling (and the
    overhead) for each R in closed form."""
    rows = [tuple(float(x) for x in p) for p in points]
    if not rows:
        raise ValueError("no points to fit: every shape was skipped; give shapes that fit in memory (--shapes)")
    if any(len(p) not in (2, 3) for p in rows):
        raise ValueError(f"a point is (intensity, fraction) or (intensity, fraction, seconds), got {points[0]!r}")
    bad = [p for p in rows if not all(math.isfinite(x) and x > 0 for x in p)]
    if bad:
        raise ValueError(f"points must have finite intensity, fraction (and seconds) > 0, got {bad[0]}")
    timed = all(len(p) == 3 for p in rows)
    pts: list[Point] = [(p[0], p[1], p[2] if timed else 0.0) for p in rows]
    constant = _best_ceiling(pts, 0.0)
    best = _search_ridge(pts, _best_ceiling)
    roofline = best if best.rms_residual < constant.rms_residual else Fit(
        "roofline", constant.ceiling, 0.0, constant.rms_residual, constant.max_residual)
    chosen = "roofline" if _better(roofline, constant, ROOFLINE_GAIN) else "constant"
    if not timed:
        return FractionFit(constant, roofline, chosen)
    # R = 0 (a constant plus overhead) is a candidate too: the search only nears it
    overhead = min(_search_ridge(pts, _best_ceiling_and_overhead), _best_ceiling_and_overhead(pts, 0.0),
                   key=lambda fit: fit.rms_residual)
    before, params = (roofline, 2) if chosen == "roofline" else (constant, 1)
    n = len(pts)
    # compared as residual standard errors (RMS * sqrt(n / (n - parameters))): a third
    # parameter over a handful of points would otherwise be chosen for fitting their noise
    if n > 3 and _better(_scaled(overhead, math.sqrt(n / (n - 3))), _scaled(before, math.sqrt(n / (n - params))),
                         OVERHEAD_GAIN):
        chosen = OVERHEAD_FORM
    return FractionFit(constant, roofline, chosen, overhead)


def fit_part_overhead(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares t0 >= 0 of the relative residuals (flops_time + t0) / t - 1 over
    (flops_time, t) points (t > 0; flops_time the part's FLOPs at the fitted fraction, 0
    without FLOPs): t0 = sum((t - flops_time) / t^2) / sum(1 / t^2); 0 without points."""
    usable = [(a, t) for a, t in points if math.isfinite(a) and math.isfinite(t) and t > 0 and a >= 0]
    if not usable:
        return 0.0
    return max(0.0, sum((t - a) / (t * t) for a, t in usable) / sum(1.0 / (t * t) for _, t in usable))


def fit_link(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept s, slope s/byte) of time = intercept + slope * bytes, least squares over
    (bytes, seconds) points; the intercept at least 0, the slope above 0."""
    n = len(points)
    if n < 2:
        raise ValueError(f"a link fit needs two message sizes or more, got {n}")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx > 0 else 0.0
    if slope <= 0:  # no growth with size: the largest message's time over its size
        x, y = max(points)
        slope = y / x
    return max(0.0, my - slope * mx), slope


def link_fields(p2p: Sequence[tuple[float, float]], all_reduce: Sequence[tuple[float, float]], ranks: int) -> dict:
    """The profile's links from measured (bytes, seconds): a point-to-point hop is latency +
    bytes / bandwidth; a ring all-reduce over d ranks is 2(d-1) * latency + 2(d-1)/d * bytes /
    bandwidth (`core.cost.dp_model.all_reduce_time`), solved for its step latency and bandwidth."""
    latency, slope = fit_link(p2p)
    ring_a, ring_slope = fit_link(all_reduce)
    d = max(2, ranks)
    return {
        "measured": True,
        "p2p": {"latency_s": latency, "bandwidth_bytes_per_s": 1.0 / slope, "points": [list(x) for x in p2p]},
        "all_reduce": {"latency_s": ring_a / (2 * (d - 1)), "bandwidth_bytes_per_s": 2 * (d - 1) / (d * ring_slope),
                       "ranks": d, "points": [list(x) for x in all_reduce]},
    }


UNMEASURED_LINKS = {
    "measured": False,
    "note": "not measured (calibrate --no-links): an assumed link, gloo over loopback's order of magnitude",
    "p2p": {"latency_s": 50e-6, "bandwidth_bytes_per_s": 1e9},
    "all_reduce": {"latency_s": 50e-6, "bandwidth_bytes_per_s": 1e9},
}


def build_profile(
    *, name: str, peak_flops: float, peak_how: str, points: Sequence[dict], links: dict | None = None,
    memory_bandwidth: float | None = None, ranks_per_node: int = 1, about: dict | None = None,
    fit_parts: Sequence[str] = ("block",),
) -> dict:
    """The profile document (FORMAT) from measured points: each point a dict with part,
    pass ("F", "B" or "W"), seconds, flops and intensity (and the shape's fields). The
    fractions are fitted per pass kind over the points of `fit_parts` that have FLOPs; each
    point gets its fraction and the chosen fit's residual."""
    if not (math.isfinite(peak_flops) and peak_flops > 0):
        raise ValueError(f"peak FLOP/s must be finite and > 0, got {peak_flops}")
    points = [dict(x) for x in points]
    for point in points:
        point["fraction"] = point["flops"] / (point["seconds"] * peak_flops) if point["seconds"] > 0 else None
    fits, total_flops, total_seconds = {}, 0.0, 0.0
    for kind in PASS_KINDS:
        usable = [x for x in points if x["pass"] == kind and x["part"] in fit_parts and x["flops"] > 0
                  and x["seconds"] > 0 and x["intensity"] > 0]
        fit = fit_fraction([(x["intensity"], x["fraction"], x["seconds"]) for x in usable])
        fits[kind] = fit.to_json()
        best = fit.best.efficiency()

        def flops_time(x: dict, best: PassEfficiency = best) -> float:
            return x["flops"] / (peak_flops * best.at(x["intensity"])) if x["flops"] > 0 else 0.0

        overheads = {part: best.overhead for part in fit_parts}
        for part in END_PARTS:
            mine = [x for x in points if x["pass"] == kind and x["part"] == part]
            # a part timed as 0 somewhere (its stage took less than the block: stage 0's W,
            # the whole backward in one pass, is cheaper than a block's B and W apart) has
            # no time of its own to fit
            if mine and all(x["seconds"] > 0 for x in mine):
                overheads[part] = fits[kind][f"{part}_overhead_s"] = fit_part_overhead(
                    [(flops_time(x), x["seconds"]) for x in mine])
        for x in points:
            if x["pass"] == kind and x["seconds"] > 0 and (x["flops"] > 0 or x["part"] in overheads):
                x["residual"] = (flops_time(x) + overheads.get(x["part"], 0.0)) / x["seconds"] - 1.0
        total_flops += sum(x["flops"] for x in usable)
        total_seconds += sum(x["seconds"] for x in usable)
    efficiency = min(1.0, total_flops / (total_seconds * peak_flops))
    return {
        "format": FORMAT, "name": name, **(about or {}),
        "peak": {"flops": peak_flops, "how": peak_how},
        "efficiency": efficiency,
        "fits": fits,
        "fit_rule": (f"per pass kind over the {', '.join(fit_parts)} points: time = FLOPs / (peak * fraction) + "
                     "overhead_s, fraction = ceiling / (1 + ridge / I), I the matrix products' FLOPs per byte; the "
                     f"roofline is chosen when its RMS relative time residual is below {ROOFLINE_GAIN:g} x the "
                     f"constant's, the roofline plus overhead when its residual standard error is below "
                     f"{OVERHEAD_GAIN:g} x the one chosen of those two; the embedding's and the head's fixed time per "
                     "pass (embedding_overhead_s, head_overhead_s) by least squares at the chosen fraction"),
        "links": links if links is not None else UNMEASURED_LINKS,
        "memory_bandwidth_bytes_per_s": memory_bandwidth,
        "ranks_per_node": ranks_per_node,
        "points": points,
    }


# ---- the file ------------------------------------------------------------------------------

def is_profile_path(text: str) -> bool:
    """Whether `--hardware TEXT` names a file (a .json name or a path) rather than a preset."""
    return text.lower().endswith(".json") or os.sep in text or (os.altsep is not None and os.altsep in text)


def hardware_names_text() -> str:
    return ", ".join(sorted(HARDWARE))


def resolve_hardware(text: str) -> Hardware:
    """A preset of `sim.analytic.HARDWARE` by name, or the profile in the file `text`."""
    if text in HARDWARE:
        return HARDWARE[text]
    if is_profile_path(text) or Path(text).is_file():
        return load_profile(text)
    raise ScheduleError(
        f"--hardware {text!r}: not a preset ({hardware_names_text()}) nor a profile file; give a preset name or "
        "the path of a PROFILE.json written by `pipeblocks calibrate`"
    )


def check_hardware_text(text: str) -> str:
    """argparse type for --hardware: the text, once it names a preset or a readable profile."""
    try:
        resolve_hardware(text)
    except (ScheduleError, ValueError, OSError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def load_profile(path: str | os.PathLike) -> Hardware:
    """The Hardware a profile file describes; ValueError in one line naming the file and the
    field when it is not a valid profile."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"hardware profile {str(path)!r} does not exist: give the file `pipeblocks calibrate -o` "
                         f"wrote, or a preset ({hardware_names_text()})") from None
    except OSError as err:
        raise ValueError(f"hardware profile {str(path)!r} cannot be read: {err.strerror}") from None
    try:
        data = json.loads(text)  # NaN and Infinity parse, and are refused below by the field's name
    except json.JSONDecodeError as err:
        raise ValueError(f"hardware profile {str(path)!r} is not JSON (line {err.lineno}: {err.msg}): give the file "
                         "`pipeblocks calibrate -o` wrote") from None
    return profile_hardware(data, source=str(path))


def _field(data: Any, dotted: str, source: str, *, minimum: float | None = 0.0, strict: bool = True,
           optional: bool = False) -> float | None:
    value: Any = data
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            if optional:
                return None
            raise ValueError(f"hardware profile {source!r}: field {dotted} is missing; give the file "
                             "`pipeblocks calibrate -o` wrote")
        value = value[key]
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"hardware profile {source!r}: field {dotted} must be a finite number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        relation = ">" if strict else ">="
        raise ValueError(f"hardware profile {source!r}: field {dotted} must be {relation} {minimum:g}, got {value!r}")
    return float(value)


def profile_hardware(data: Any, *, source: str = "<profile>") -> Hardware:
    """Validate a parsed profile and build its Hardware (see the module docstring)."""
    if not isinstance(data, dict):
        raise ValueError(f"hardware profile {source!r}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise ValueError(f"hardware profile {source!r}: field format is {data.get('format')!r}, expected {FORMAT!r}; "
                         "give a file written by `pipeblocks calibrate -o`")
    flops = _field(data, "peak.flops", source)
    efficiency = _field(data, "efficiency", source)
    if efficiency > 1:
        raise ValueError(f"hardware profile {source!r}: field efficiency must be <= 1, got {efficiency!r}")
    passes = []
    for kind in PASS_KINDS:
        fit = data.get("fits", {}).get(kind) if isinstance(data.get("fits"), dict) else None
        if not isinstance(fit, dict):
            raise ValueError(f"hardware profile {source!r}: field fits.{kind} is missing; give the file "
                             "`pipeblocks calibrate -o` wrote")
        ceiling = _field(data, f"fits.{kind}.ceiling", source)
        ridge = _field(data, f"fits.{kind}.ridge", source, strict=False)
        # written since the fit has overhead terms; an older profile has none (0 s)
        overhead, embedding, head = (_field(data, f"fits.{kind}.{name}", source, strict=False, optional=True) or 0.0
                                     for name in ("overhead_s", "embedding_overhead_s", "head_overhead_s"))
        passes.append(PassEfficiency(ceiling, ridge, overhead, embedding, head))
    latency = _field(data, "links.p2p.latency_s", source, strict=False)
    bandwidth = _field(data, "links.p2p.bandwidth_bytes_per_s", source)
    ring_latency = _field(data, "links.all_reduce.latency_s", source, strict=False)
    ring_bandwidth = _field(data, "links.all_reduce.bandwidth_bytes_per_s", source)
    memory = _field(data, "memory_bandwidth_bytes_per_s", source, optional=True)
    # a pair's hidden share (DualPipe's F&B); calibrate measures none on a CPU: absent = 0
    overlap = _field(data, "overlap", source, strict=False, optional=True) or 0.0
    per_node = data.get("ranks_per_node", 1)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ValueError(f"hardware profile {source!r}: field ranks_per_node must be an integer >= 1, got {per_node!r}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        name = Path(source).stem
    return Hardware(
        name, flops=flops, efficiency=efficiency, bandwidth=bandwidth, latency=latency, gpus_per_node=per_node,
        intra_bandwidth=ring_bandwidth, intra_latency=ring_latency, inter_bandwidth=ring_bandwidth,
        inter_latency=ring_latency, memory_bandwidth=memory, passes=tuple(passes), overlap=overlap,
    )
