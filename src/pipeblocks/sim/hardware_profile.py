"""Hardware profiles measured by `pipeblocks calibrate`: the fit, the file, and the lookup
that lets every `--hardware` take a preset name or a profile file.

    >>> hardware = resolve_hardware("a100")                 # a built-in preset (sim.analytic.HARDWARE)
    >>> hardware = resolve_hardware("cpu.json")             # a profile written by `pipeblocks calibrate`
    >>> fit = fit_fraction([(intensity, fraction), ...])    # constant and roofline fits, and which is better

A profile is JSON (FORMAT below). What the simulator and the planner read from it:

    peak.flops                   FLOP/s taken as the peak (on a CPU: a large matmul's, measured)
    fits.F|B|W.chosen            "constant" or "roofline"; the chosen fit's ceiling and ridge
                                 give the pass's fraction of the peak at intensity I:
                                 ceiling / (1 + ridge / I) (ridge 0 under "constant")
    efficiency                   one fraction for consumers that take one (FLOP-weighted over
                                 the passes' points)
    links.p2p                    latency_s, bandwidth_bytes_per_s of one pipeline hop
    links.all_reduce             latency_s, bandwidth_bytes_per_s of a ring step (data parallel)
    memory_bandwidth_bytes_per_s the device memory's, or null
    ranks_per_node               devices (or processes) sharing the measured links

and `points` holds every measured pass (part, shape, seconds, FLOPs, intensity, fraction),
which the fits came from. A file that is not such a profile, or holds a field that is not
a finite number in range, is refused in one line naming the file and the field.

The fit. For each pass kind the points are (I, f) with f = FLOPs / (seconds * peak).
Constant: f = c. Roofline: f = c / (1 + R / I), with c <= 1. Both are fitted by least squares on the
relative error of the predicted time (t_pred / t - 1 = f * (1 + R / I) / c - 1: for a given
R, 1/c in closed form; R >= 0 by a search), so the residuals are relative time errors. The roofline is chosen when its
root-mean-square residual is at least 10% below the constant's (it has one parameter more).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..core.errors import ScheduleError
from .analytic import HARDWARE, Hardware, PassEfficiency

__all__ = [
    "FORMAT", "PASS_KINDS", "Fit", "FractionFit", "fit_fraction", "load_profile", "profile_hardware",
    "resolve_hardware", "hardware_names_text", "is_profile_path", "check_hardware_text", "fit_link", "link_fields",
    "build_profile", "UNMEASURED_LINKS",
]

FORMAT = "pipeblocks-hardware-profile/1"
PASS_KINDS = ("F", "B", "W")
ROOFLINE_GAIN = 0.9
"""The roofline is chosen when its RMS residual is below this share of the constant's."""


@dataclass(frozen=True)
class Fit:
    """One form's fit: ceiling, ridge (0 for a constant), and its relative time residuals."""

    form: str
    ceiling: float
    ridge: float
    rms_residual: float
    max_residual: float

    def efficiency(self) -> PassEfficiency:
        return PassEfficiency(self.ceiling, self.ridge)

    def to_json(self) -> dict:
        return {"form": self.form, "ceiling": self.ceiling, "ridge": self.ridge,
                "rms_residual": self.rms_residual, "max_residual": self.max_residual}


@dataclass(frozen=True)
class FractionFit:
    """Both fits of one pass kind and the one chosen."""

    constant: Fit
    roofline: Fit
    chosen: str

    @property
    def best(self) -> Fit:
        return self.roofline if self.chosen == "roofline" else self.constant

    def to_json(self) -> dict:
        return {"chosen": self.chosen, "ceiling": self.best.ceiling, "ridge": self.best.ridge,
                "constant": self.constant.to_json(), "roofline": self.roofline.to_json()}


def _residuals(points: Sequence[tuple[float, float]], alpha: float, beta: float) -> list[float]:
    return [f * (alpha + beta / i) - 1.0 for i, f in points]


def _fit(form: str, points: Sequence[tuple[float, float]], alpha: float, beta: float) -> Fit:
    res = _residuals(points, alpha, beta)
    return Fit(form, 1.0 / alpha, beta / alpha, math.sqrt(sum(r * r for r in res) / len(res)),
               max(abs(r) for r in res))


def _best_ceiling(points: Sequence[tuple[float, float]], ridge: float) -> Fit:
    """For a fixed ridge R, the least-squares 1/c (closed form, the ceiling at most 1: no
    more than the peak) and its residuals."""
    g = [f * (1.0 + ridge / i) for i, f in points]
    alpha = max(1.0, sum(g) / sum(x * x for x in g))
    return _fit("roofline" if ridge > 0 else "constant", points, alpha, alpha * ridge)


def fit_fraction(points: Sequence[tuple[float, float]]) -> FractionFit:
    """Fit (intensity, fraction) points with a constant and with the roofline form (see the
    module docstring); intensities and fractions must be > 0. The roofline's ridge R >= 0 is
    searched on a logarithmic grid, then by golden section around the best, the ceiling for
    each R in closed form."""
    points = [(float(i), float(f)) for i, f in points]
    if not points:
        raise ValueError("no points to fit: every shape was skipped; give shapes that fit in memory (--shapes)")
    bad = [(i, f) for i, f in points if not (math.isfinite(i) and math.isfinite(f) and i > 0 and f > 0)]
    if bad:
        raise ValueError(f"points must have finite intensity > 0 and fraction > 0, got {bad[0]}")
    constant = _best_ceiling(points, 0.0)
    top = max(i for i, _ in points)
    grid = [top * 10 ** (k / 50) for k in range(-300, 151)]  # R from 1e-6 to 1e3 times the largest intensity
    best = min((_best_ceiling(points, r) for r in grid), key=lambda fit: fit.rms_residual)
    # golden-section search between the best grid point's neighbours
    lo, hi = math.log(best.ridge) - math.log(10) / 50, math.log(best.ridge) + math.log(10) / 50
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if _best_ceiling(points, math.exp(a)).rms_residual < _best_ceiling(points, math.exp(b)).rms_residual:
            hi = b
        else:
            lo = a
    best = min(best, _best_ceiling(points, math.exp((lo + hi) / 2)), key=lambda fit: fit.rms_residual)
    roofline = best if best.rms_residual < constant.rms_residual else Fit(
        "roofline", constant.ceiling, 0.0, constant.rms_residual, constant.max_residual)
    chosen = "roofline" if roofline.rms_residual < ROOFLINE_GAIN * constant.rms_residual else "constant"
    return FractionFit(constant, roofline, chosen)


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
    bandwidth (`core.dp_model.all_reduce_time`), solved for its step latency and bandwidth."""
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
        fit = fit_fraction([(x["intensity"], x["fraction"]) for x in usable])
        fits[kind] = fit.to_json()
        best = fit.best.efficiency()
        for x in points:
            if x["pass"] == kind and x["flops"] > 0 and x["seconds"] > 0:
                x["residual"] = x["flops"] / (peak_flops * best.at(x["intensity"])) / x["seconds"] - 1.0
        total_flops += sum(x["flops"] for x in usable)
        total_seconds += sum(x["seconds"] for x in usable)
    efficiency = min(1.0, total_flops / (total_seconds * peak_flops))
    return {
        "format": FORMAT, "name": name, **(about or {}),
        "peak": {"flops": peak_flops, "how": peak_how},
        "efficiency": efficiency,
        "fits": fits,
        "fit_rule": (f"per pass kind over the {', '.join(fit_parts)} points: fraction = ceiling / (1 + ridge / I), "
                     "I the matrix products' FLOPs per byte; the roofline is chosen when its RMS relative time "
                     f"residual is below {ROOFLINE_GAIN:g} x the constant's"),
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
    import argparse

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
        passes.append(PassEfficiency(ceiling, ridge))
    latency = _field(data, "links.p2p.latency_s", source, strict=False)
    bandwidth = _field(data, "links.p2p.bandwidth_bytes_per_s", source)
    ring_latency = _field(data, "links.all_reduce.latency_s", source, strict=False)
    ring_bandwidth = _field(data, "links.all_reduce.bandwidth_bytes_per_s", source)
    memory = _field(data, "memory_bandwidth_bytes_per_s", source, optional=True)
    per_node = data.get("ranks_per_node", 1)
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ValueError(f"hardware profile {source!r}: field ranks_per_node must be an integer >= 1, got {per_node!r}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        name = Path(source).stem
    return Hardware(
        name, flops=flops, efficiency=efficiency, bandwidth=bandwidth, latency=latency, gpus_per_node=per_node,
        intra_bandwidth=ring_bandwidth, intra_latency=ring_latency, inter_bandwidth=ring_bandwidth,
        inter_latency=ring_latency, memory_bandwidth=memory, passes=tuple(passes),
    )
