"""The sweep of `benchmarks/pipemesh.py --sweep`: where depth-first idles on data-parallel
communication as much as the PipeMesh paper reports (about 28% of the step), and how much
of that idle time elastic removes there.

    python benchmarks/pipemesh.py --sweep [--models 6.2b] [-p 4] [-m 32] [--hardware cloud]
        [--sweep-v 2 4] [--sweep-bandwidth 2 3.125 6.25 10 12.5 25] [--sweep-latency 30]
        [--sweep-microbatch 1 3] [--sweep-dp 16]
        [--sweep-sharding zero3 ends=replicate first=zero1 firsts=replicate replicate,zero3,...]
        [--dp-unit block] [--json FILE] [--plot docs/images/pipemesh-sweep.png]

Every combination of the axes is one point: v, the DP link (GB/s and microseconds per ring
step, set explicitly, so d changes only the ring and the memory, not which link is used),
the sequences per microbatch, d, and the sharding per chunk: a policy for every chunk, one
per global stage, or PipeMesh's mixed sharding, a policy on the end stages and zero3
between (`ends=POLICY`: global stages 0 and S-1; `first=POLICY`: stage 0 only;
`firsts=POLICY`: every rank's first chunk, which it starts and ends its step with). At each
point `pipemesh.compare` runs depth-first, breadth-first and elastic as the table does, and
the sweep reports:

    idle      depth-first's exposed DP communication over its step (the paper's idle time)
    gain      elastic's speed-up over the fastest baseline that fits the memory budget
    removed   the share of depth-first's exposed communication elastic removes,
              1 - elastic exposed / depth-first exposed (both the largest over ranks)
    floor     what rank 0 waits for before its first pass and after its last, the least over
              the three orders: its first chunk's gather and reduction, which no order hides
    max rm    1 - floor / depth-first exposed: the most any order can remove
    max gain  the gain if elastic exposed only the floor (its step less its exposure above
              the floor; an estimate: the exposure is taken to lie on the critical path)
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from pipeblocks.resolve.request import CostSpec, Mesh, ScheduleRequest
from pipeblocks.core.ir.sharding import ShardingPolicy, parse_sharding, per_stage

__all__ = ["Point", "sharding_policies", "grid", "sweep_point", "run_sweep", "regime_summary", "main_sweep"]

REGIME = (0.20, 0.35)  # depth-first's idle share around the paper's 28%
TARGET_GAIN, TARGET_REMOVED = 1.15, 0.60  # the reading of "+20.1% to +33.8%" and "removes most"
# which global stages a mixed sharding leaves to its policy, from (stages, p)
_EDGES = {"ends": lambda stages, p: {0, stages - 1}, "first": lambda stages, p: {0},
          "firsts": lambda stages, p: set(range(p))}
_SCHEDULES = ("depth-first", "breadth-first", "elastic")


@dataclass(frozen=True)
class Point:
    """One point of the sweep."""

    model: str
    v: int
    """chunks per rank"""
    bandwidth: float
    """DP link, GB/s"""
    latency: float
    """DP latency per ring step, microseconds"""
    microbatch: int | None
    """sequences per microbatch (None: the model's own)"""
    dp: int
    sharding: str
    """a label `sharding_policies` reads"""


def sharding_policies(label: str, num_stages: int, p: int) -> tuple[ShardingPolicy, ...]:
    """One policy per global stage from a sweep's label: 'zero3' (every chunk),
    'replicate,zero3,...' (one per stage), or POLICY on some stages and zero3 on the others:
    'ends=POLICY' (global stages 0 and S-1), 'first=POLICY' (stage 0), 'firsts=POLICY'
    (every rank's first chunk, stages 0..p-1: the chunk each rank starts and ends with)."""
    where, _, policy = label.partition("=")
    if not policy:
        return per_stage(parse_sharding(label), num_stages)
    if where not in _EDGES:
        raise ValueError(f"--sweep-sharding {label!r}: give POLICY, a list, or {'|'.join(_EDGES)}=POLICY")
    edge = parse_sharding(policy)
    if len(edge) != 1:
        raise ValueError(f"--sweep-sharding {label!r}: one policy after '{where}='")
    ends = _EDGES[where](num_stages, p)
    return tuple(edge[0] if s in ends else ShardingPolicy.ZERO3 for s in range(num_stages))


def grid(args: argparse.Namespace) -> list[Point]:
    """Every combination of the sweep's axes, the bandwidth varying fastest."""
    axes = (args.models.split(","), args.sweep_v, args.sweep_sharding, args.sweep_dp,
            args.sweep_microbatch, args.sweep_latency, args.sweep_bandwidth)
    return [Point(model, v, bw, lat, mb, dp, shard)
            for model, v, shard, dp, mb, lat, bw in itertools.product(*axes)]


def point_request(args: argparse.Namespace, point: Point) -> ScheduleRequest:
    """The request `pipemesh.compare` runs at `point` (its name is replaced per schedule)."""
    costs = CostSpec(model=point.model, hardware=args.hardware, mixed_precision=args.mixed_precision,
                     dp_unit=args.dp_unit, dp_prefetch=args.prefetch, dp_bandwidth=point.bandwidth,
                     dp_latency=point.latency, microbatch_size=point.microbatch)
    return ScheduleRequest(
        name="bfs", m=args.m, mesh=Mesh(pp=args.p, dp=point.dp), options=(("v", point.v),), costs=costs,
        gpu_memory=args.gpu_memory, sharding=sharding_policies(point.sharding, args.p * point.v, args.p),
    )


def _floor(row: dict) -> tuple[float, str]:
    """Rank 0's waits before its first pass and after its last, the least over the orders
    (and which order has it): the same first pass and last backward bound every order."""
    edges = {label: row[label]["rank0_edges"] for label in _SCHEDULES if "error" not in row[label]}
    label = min(edges, key=lambda k: edges[k]["lead_s"] + edges[k]["tail_s"])
    return edges[label]["lead_s"] + edges[label]["tail_s"], label


def _fastest_fitting(row: dict) -> str | None:
    fitting = [label for label in _SCHEDULES[:2] if row[label]["fits"]]
    return min(fitting, key=lambda label: row[label]["step_s"]) if fitting else None


def shares(row: dict) -> dict:
    """The sweep's figures at one point, from `pipemesh.compare`'s row."""
    depth, elastic = row["depth-first"], row["elastic"]
    exposed = depth["exposed_s"]
    floor, floor_from = _floor(row)
    out = {"idle_share": exposed / depth["step_s"], "floor_s": floor, "floor_from": floor_from,
           "removable_share": 1 - floor / exposed if exposed > 0 else None,
           "gain": None, "gain_vs": _fastest_fitting(row), "removed_share": None, "gain_bound": None}
    if "error" in elastic:
        return out
    best = out["gain_vs"]
    # `compare` has both: its speed-up over the fastest fitting baseline and its cut of depth-first's exposure
    out["gain"], out["removed_share"] = row["speedup_vs_best_fitting"], row["exposed_cut_vs_depth_first"]
    if best:
        # elastic's step with only the floor exposed (what it exposes above the floor taken off)
        floor_step = elastic["step_s"] - (elastic["exposed_s"] - floor)
        out["gain_bound"] = row[best]["step_s"] / floor_step
    return out


def _in_regime(idle: float) -> bool:
    return REGIME[0] <= idle <= REGIME[1]


def sweep_point(args: argparse.Namespace, point: Point, compare: Callable[[ScheduleRequest], dict]) -> dict:
    cpu = time.process_time()
    row = {**asdict(point), **compare(point_request(args, point))}
    row.update(shares(row))
    row["in_regime"] = _in_regime(row["idle_share"])
    gain, removed = row["gain"], row["removed_share"]
    row["target_met"] = gain is not None and removed is not None and gain >= TARGET_GAIN and removed >= TARGET_REMOVED
    row["cpu_s"] = time.process_time() - cpu
    return row


def run_sweep(args: argparse.Namespace, compare: Callable[[ScheduleRequest], dict],
              log: Callable[[str], None] | None = None) -> list[dict]:
    points = grid(args)
    rows = []
    for k, point in enumerate(points, 1):
        rows.append(sweep_point(args, point, compare))
        if log:  # a sweep takes minutes: say where it is
            log(f"[{k}/{len(points)}] {_describe(rows[-1])}: {rows[-1]['cpu_s']:.1f} s CPU")
    return rows


def _best(rows: list[dict], key: str) -> dict | None:
    defined = [r for r in rows if r[key] is not None]
    return max(defined, key=lambda r: r[key]) if defined else None


def regime_summary(rows: list[dict]) -> dict:
    """The points where depth-first idles 20-35%: the one with elastic's best gain, the one
    with the most removed, the points meeting both targets, and the most any order could
    remove there (rank 0's floor)."""
    inside = [r for r in rows if r["in_regime"]]
    pick = {key: _best(inside, key) for key in ("gain", "removed_share", "removable_share")}
    return {
        "regime": list(REGIME), "targets": {"gain": TARGET_GAIN, "removed": TARGET_REMOVED},
        "points": len(inside), "target_met": [_brief(r) for r in inside if r["target_met"]],
        **{f"best_{key}": None if r is None else _brief(r) for key, r in pick.items()},
    }


_FIGURES = ("idle_share", "gain", "gain_vs", "removed_share", "floor_s", "removable_share", "gain_bound")


def _brief(row: dict) -> dict:
    """A point, its figures, and what rank 0 waits for under elastic (the floor's ops)."""
    edges = row["elastic"].get("rank0_edges")
    return {**{key: row[key] for key in Point.__dataclass_fields__}, **{key: row[key] for key in _FIGURES},
            "depth_first_exposed_s": row["depth-first"]["exposed_s"],
            "elastic_exposed_s": row["elastic"].get("exposed_s"), "elastic_rank0_edges": edges}


# ---- the table -------------------------------------------------------------------------

def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _gain(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}x"


def _line(r: dict) -> str:
    d, e = r["depth-first"], r["elastic"]
    mb = "-" if r["microbatch"] is None else str(r["microbatch"])
    fits = "+r" if d.get("recomputed") else "" if d["fits"] else "!"
    head = (f"{'*' if r['in_regime'] else ' '} {r['v']:>1} {r['bandwidth']:7.4g} {r['latency']:6.4g} {mb:>3} "
            f"{r['dp']:>3} {r['sharding']:<16} {d['step_s']:7.3f}{fits:<2} {d['exposed_s']:6.3f} "
            f"{_pct(r['idle_share']):>6}")
    if "error" in e:
        return head + f"  elastic: {e['error'][:60]}"
    vs = {"depth-first": "df", "breadth-first": "bf"}.get(r["gain_vs"], "-")
    if r["gain_vs"] and r[r["gain_vs"]].get("recomputed"):
        vs += "+r"
    return head + (f" {e['step_s']:7.3f} {e['exposed_s']:6.3f} {_gain(r['gain']):>7} {vs:<5}"
                   f"{_pct(r['removed_share']):>7} {r['floor_s']:6.3f} {_pct(r['removable_share']):>7} "
                   f"{_gain(r['gain_bound']):>7}  {'yes' if r['target_met'] else 'no':>3}")


HEADER = (f"  v {'bw GB/s':>7} {'lat us':>6} {'mb':>3} {'d':>3} {'sharding':<16} {'df step':>7}   {'df exp':>6} "
          f"{'idle':>6} {'el step':>7} {'el exp':>6} {'gain':>7} {'vs':<5}{'removed':>7} {'floor':>6} "
          f"{'max rm':>7} {'max gain':>7}  tgt")


def _edges_text(edges: dict) -> str:
    """Rank 0's two waits, op by op, against the passes they sit beside."""
    lines = []
    for side, ops, wait, where in (("lead", edges["lead_ops"], edges["lead_s"], "before its first pass"),
                                   ("tail", edges["tail_ops"], edges["tail_s"], "after its last pass")):
        passed = edges["first_pass" if side == "lead" else "last_pass"]
        what = ", ".join(f"{o['op']} {o['duration_s']:.3f} s" for o in ops)
        lines.append(f"    {where} ({passed['action']}, {passed['duration_s']:.3f} s) rank 0 "
                     + (f"waits {wait:.3f} s for {what}" if wait > 0 else "does not wait"))
    return "\n".join(lines)


def _describe(row: dict) -> str:
    mb = "the model's" if row["microbatch"] is None else row["microbatch"]
    return (f"v {row['v']}, {row['bandwidth']:g} GB/s, {row['latency']:g} us, microbatch {mb}, d {row['dp']}, "
            f"{row['sharding']}")


def print_summary(summary: dict) -> None:
    lo, hi = (f"{100 * x:.0f}%" for x in REGIME)
    print(f"\nwhere depth-first idles {lo}-{hi} ({summary['points']} points, '*'):")
    if not summary["points"]:
        print("  none: widen the grid")
        return
    for key, what in (("gain", "best gain"), ("removed_share", "most removed")):
        best = summary[f"best_{key}"]
        if best is not None:
            print(f"  {what}: {_gain(best['gain'])}, {_pct(best['removed_share'])} of depth-first's "
                  f"{_pct(best['idle_share'])} idle removed, at {_describe(best)}")
    met = summary["target_met"]
    print(f"  target (>= {TARGET_GAIN:g}x and >= {100 * TARGET_REMOVED:.0f}% removed): "
          + (f"met at {len(met)} point(s): " + "; ".join(_describe(r) for r in met) if met else "not met"))
    bound = summary["best_removable_share"]
    if bound is not None:
        print(f"  the most any order could remove there: {_pct(bound['removable_share'])}, at {_describe(bound)}")
    best = summary["best_removed_share"]
    if best is not None and best["elastic_rank0_edges"]:
        print(f"  what stays exposed at the most removed: rank 0's floor, {best['floor_s']:.3f} s of elastic's "
              f"{best['elastic_exposed_s']:.3f} s (depth-first {best['depth_first_exposed_s']:.3f} s)")
        print(_edges_text(best["elastic_rank0_edges"]))


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"{args.models} p={args.p} m={args.m} --hardware {args.hardware} --gpu-memory "
          f"{args.gpu_memory:g} --dp-unit {args.dp_unit}{' --mixed-precision' if args.mixed_precision else ''}")
    print("step and exposed DP communication in s; idle: depth-first's exposed share of its step; gain: elastic "
          "over the fastest fitting baseline (df depth-first, bf breadth-first; +r: run with full recomputation, "
          "the only way it fits; !: does not fit); "
          "removed: of depth-first's exposed; floor: rank 0's first gather and last reduction; max rm, max gain: "
          "with only the floor exposed")
    print(HEADER)
    for r in rows:
        print(_line(r))


# ---- the picture ---------------------------------------------------------------------------

def plot(rows: list[dict], path: str) -> str:
    """Elastic's gain and removed share against depth-first's idle share: one curve per
    (v, sharding, microbatch, d, latency) over the bandwidths, the 20-35% band shaded, the
    targets dashed, and the most removable (rank 0's floor) dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (gain_ax, removed_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = {key: f"C{i}" for i, key in enumerate(dict.fromkeys((r["v"], r["sharding"]) for r in rows))}
    markers = dict(zip(dict.fromkeys(r["microbatch"] for r in rows), "os^Dvp*"))
    varied = {key for key in ("model", "dp", "latency") if len({r[key] for r in rows}) > 1}
    curves: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["gain"] is not None:
            key = (r["v"], r["sharding"], r["microbatch"], r["model"], r["dp"], r["latency"])
            curves.setdefault(key, []).append(r)
    for (v, shard, mb, model, dp, lat), curve in curves.items():
        curve.sort(key=lambda r: r["idle_share"])
        x = [100 * r["idle_share"] for r in curve]
        style = dict(color=colours[(v, shard)], marker=markers[mb], markersize=5, linewidth=1)
        extra = {"model": model, "dp": f"d {dp}", "latency": f"{lat:g} us"}
        label = ", ".join([f"v {v}", shard, f"mb {mb or '-'}", *(extra[k] for k in sorted(varied))])
        gain_ax.plot(x, [r["gain"] for r in curve], label=label, **style)
        removed_ax.plot(x, [100 * r["removed_share"] for r in curve], **style)
        removed_ax.plot(x, [100 * r["removable_share"] for r in curve], **{**style, "linestyle": ":",
                        "markerfacecolor": "none", "linewidth": 0.8})
    for ax, target in ((gain_ax, TARGET_GAIN), (removed_ax, 100 * TARGET_REMOVED)):
        ax.axvspan(100 * REGIME[0], 100 * REGIME[1], color="0.9", zorder=0)
        ax.axhline(target, color="0.4", linestyle="--", linewidth=0.8)
        ax.set_xlabel("depth-first's exposed DP communication, % of its step")
    gain_ax.set_ylabel("elastic over the fastest fitting baseline")
    removed_ax.set_ylabel("% of depth-first's exposed communication")
    gain_ax.set_title(f"elastic's gain (dashed: {TARGET_GAIN:g}x; shaded: depth-first idles 20-35%)", fontsize=10)
    removed_ax.set_title("removed by elastic (solid) and removable by any order (dotted)", fontsize=10)
    gain_ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main_sweep(args: argparse.Namespace, compare: Callable[[ScheduleRequest], dict],
               json_only: Callable[[object, str | None], bool]) -> int:
    """Run the grid; `json_only` (pipemesh's) writes --json and says whether it replaces the table."""
    rows = run_sweep(args, compare, log=lambda text: print(text, file=sys.stderr, flush=True))
    summary = regime_summary(rows)
    if args.plot:
        plot(rows, args.plot)
    if json_only({"rows": rows, "summary": summary}, args.json):
        return 0
    print_table(rows, args)
    print_summary(summary)
    if args.plot:
        print(f"\nplot: {args.plot}")
    print(f"total CPU {time.process_time():.1f} s")
    return 0
