"""Generation at scale: the schedules stay what they were, and the work grows linearly.

The block builder (`blocks.build_orders`, the slot grid of `_grid`) was rewritten for
speed; every schedule it makes must be the one the first version made. DIGESTS holds the
first 16 hex digits of the SHA-256 of `Schedule.to_text()` as the generators gave them
before the rewrite; a differing digest names the case, and `to_text()` shows the change.
"""
from __future__ import annotations

import hashlib
import sys

import pytest

from pipeblocks.schedules import get
from pipeblocks.sim import Costs

COSTS = {"unit": None, "uneven": Costs(1.0, 2.0, 0.5, 0.1), "w-light": Costs(2.0, 1.0, 1.5, 0.3, mem_w_ratio=0.5)}

# "<name> p=<p> m=<m> <costs>": digest
DIGESTS = {
    "v-half p=2 m=2 unit": "dec1252e0be99aa3",
    "v-half p=4 m=8 unit": "fbbaa70722ea7fee",
    "v-half p=5 m=13 unit": "241cad0cfdf7be57",
    "v-half p=8 m=24 unit": "b3ba88e5e9f82cd0",
    "v-half p=16 m=64 unit": "ff0df001e45af09b",
    "v-min p=2 m=2 unit": "7ef0a5182df7afe9",
    "v-min p=4 m=8 unit": "98d454e51bccb8ca",
    "v-min p=5 m=13 unit": "4259539859491129",
    "v-min p=8 m=24 unit": "5c77e240f088c74f",
    "v-min p=16 m=64 unit": "f4b0261859c05d9f",
    "v-zb p=2 m=2 unit": "b941d683f2d0bce0",
    "v-zb p=4 m=8 unit": "d5c0b144c60ca1b8",
    "v-zb p=5 m=13 unit": "cd2a2a828e1805fc",
    "v-zb p=8 m=24 unit": "30a7a47ac6e8fd15",
    "v-zb p=16 m=64 unit": "1f44553dea3e0f44",
    "zb-v p=2 m=2 unit": "b0457daf3cc0d0b3",
    "zb-v p=4 m=8 unit": "24e99a9e453dba55",
    "zb-v p=5 m=13 unit": "31479fd76b60046d",
    "zb-v p=8 m=24 unit": "1a791089540d1d91",
    "zb-v p=16 m=64 unit": "ebda0a3c109e5ba9",
    "1f1b p=2 m=2 unit": "0199cee44cd16f91",
    "1f1b p=4 m=8 unit": "c124b1a825e12f38",
    "1f1b p=5 m=13 unit": "4982703122baa751",
    "1f1b p=8 m=24 unit": "700c50791a5a5742",
    "1f1b p=16 m=64 unit": "c4e44394ec1add13",
    "interleaved-1f1b p=2 m=2 unit": "cba8cffa2ae72d56",
    "interleaved-1f1b p=4 m=8 unit": "d74d8bb94ee7b0dc",
    "interleaved-1f1b p=5 m=13 unit": "ef0ccf75be360fe1",
    "interleaved-1f1b p=8 m=24 unit": "af99b70f3dcf98af",
    "interleaved-1f1b p=16 m=64 unit": "c3c7a55e83b77c16",
    "zb-h1 p=2 m=2 unit": "1dec9200543b2eac",
    "zb-h1 p=4 m=8 unit": "50ad369d859ea8a0",
    "zb-h1 p=5 m=13 unit": "0995e1108e074992",
    "zb-h1 p=8 m=24 unit": "984d7ea8a2a13c8f",
    "zb-h1 p=16 m=64 unit": "803378f1bd9297e4",
    "1f1b-v p=2 m=2 unit": "e3a12cb5277b6cee",
    "1f1b-v p=4 m=8 unit": "50dc2dea64592ba9",
    "1f1b-v p=5 m=13 unit": "c261a55404f9c9b4",
    "1f1b-v p=8 m=24 unit": "cef09b10476147bb",
    "1f1b-v p=16 m=64 unit": "a48a7f84856bb7b5",
    "v-half p=4 m=8 uneven": "f5e12314cb14b79c",
    "v-half p=4 m=8 w-light": "d37277c1f4242fbd",
    "v-half p=6 m=20 uneven": "8704be8fd241b7c8",
    "v-half p=6 m=20 w-light": "619b7a07e07f043d",
    "v-min p=4 m=8 uneven": "10b343d6a08103bf",
    "v-min p=4 m=8 w-light": "a43e84c7d54d190c",
    "v-min p=6 m=20 uneven": "39a12e27b55bba32",
    "v-min p=6 m=20 w-light": "c105effa52b732d3",
    "v-zb p=4 m=8 uneven": "c99d7932d98028ba",
    "v-zb p=4 m=8 w-light": "0e0f2848f6d82bbd",
    "v-zb p=6 m=20 uneven": "fb438adb92466e53",
    "v-zb p=6 m=20 w-light": "4e9021df7543b7d6",
    "zb-v p=4 m=8 uneven": "dd53793923a75b16",
    "zb-v p=4 m=8 w-light": "8cf381638e07ff87",
    "zb-v p=6 m=20 uneven": "93d6fb8cfd62248c",
    "zb-v p=6 m=20 w-light": "679268a3e8557e18",
    "1f1b-v p=4 m=8 uneven": "50dc2dea64592ba9",
    "1f1b-v p=4 m=8 w-light": "50dc2dea64592ba9",
    "1f1b-v p=6 m=20 uneven": "a73f67c7e2053702",
    "1f1b-v p=6 m=20 w-light": "a73f67c7e2053702",
    "v-adaptive p=4 m=8 unit": "80f2f31a6b2c36ba",
    "v-adaptive p=8 m=24 unit": "3870ccf063e4b75a",
}
LARGE_DIGESTS = {
    "v-half p=64 m=256 unit": "7c59e40252f87445",
    "v-min p=64 m=256 unit": "dcbfd0dcfe59c598",
    "v-zb p=64 m=256 unit": "dbe0ce60362f0934",
    "zb-v p=32 m=128 unit": "950a939412d48d08",
    "1f1b-v p=64 m=256 unit": "6a81850ca3fb6b99",
    "v-adaptive p=16 m=48 unit": "00766ef796353c4f",
    "v-half p=128 m=1024 unit": "3acf6fa138d24338",
}


def digest(case: str) -> str:
    name, p, m, costs = case.split()
    kwargs = {} if COSTS[costs] is None else {"costs": COSTS[costs]}
    schedule = get(name)(p=int(p[2:]), m=int(m[2:]), **kwargs)
    return hashlib.sha256(schedule.to_text().encode()).hexdigest()[:16]


@pytest.mark.parametrize("case", DIGESTS)
def test_schedules_are_unchanged(case):
    assert digest(case) == DIGESTS[case]


@pytest.mark.sweep
@pytest.mark.parametrize("case", LARGE_DIGESTS)
def test_large_schedules_are_unchanged(case):
    assert digest(case) == LARGE_DIGESTS[case]


@pytest.mark.parametrize("costs", [None, Costs(1.0, 2.0, 0.5, 0.1), Costs(2.0, 1.0, 1.5, 0.3, mem_w_ratio=0.5)])
def test_layout_timing_equals_the_replay_of_its_orders(costs):
    # build_orders times its candidates on the grid, without making their orders
    from pipeblocks.schedules._grid_timing import layout_peaks, layout_replay
    from pipeblocks.schedules._reorder import cost_table, float_weights_of, orders_of, peaks_of, replay
    from pipeblocks.schedules.blocks import _tiled_grid
    from pipeblocks.schedules.vshape import v_block, v_fused_block

    for block in (v_block(5, (2, 1, 2, 1)), v_block(4, (4, 2, 4, 2)), v_fused_block(4)):
        for m in (1, 3, 11):
            table = cost_table(block.placement, costs)
            grid = _tiled_grid(block, m, table)
            layouts = [grid.slots()]
            grid.compact(layout_peaks(grid, layouts[0]))
            layouts.append(grid.slots())
            float_weights_of(grid, layout_peaks(grid, layouts[0]))
            layouts.append(grid.slots())
            for slots in layouts:
                orders = orders_of(grid, slots=slots)
                assert layout_peaks(grid, slots) == peaks_of(orders, table)
                assert layout_replay(grid, slots) == replay(orders, table)


def python_lines(name: str, p: int, m: int) -> int:
    """The Python lines run to generate the schedule: a count of work, not of time."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: trace)
    try:
        get(name)(p=p, m=m)
    finally:
        sys.settrace(previous)
    return count


@pytest.mark.parametrize("name", ["v-half", "1f1b-v"])
def test_generation_work_grows_linearly(name):
    # Each further microbatch adds the same work: doubling the added microbatches doubles
    # the added lines (4x if a step scanned the passes once per pass), and doubling p at
    # the same m about doubles them (the passes double; 4x if a step went over every rank
    # for every pass). The constant part (finding the block) drops out of the differences.
    python_lines(name, 4, 8)  # the first build in a process also runs one-time set-up
    small, middle, large = (python_lines(name, 4, m) for m in (128, 256, 512))
    assert (large - middle) / (middle - small) < 2.5
    assert python_lines(name, 8, 256) / middle < 2.5
