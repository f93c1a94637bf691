"""Every registered schedule: validates over a range of (p, m), and its docstring shows its
real schedule."""
import re

import pytest

from pipeblocks import ScheduleError, schedules, simulate, validate
from pipeblocks.core.ir.ops import Recompute

NAMES = schedules.names()


def test_registry_has_the_classics():
    assert {"gpipe", "1f1b", "interleaved-1f1b", "bfs"} <= set(NAMES)
    for spec in schedules.specs().values():
        assert spec.summary and spec.name


@pytest.mark.parametrize("name", NAMES)
def test_docstring_shows_the_generated_schedule(name):
    spec = schedules.get(name)
    doc = spec.doc
    case = re.search(r"p=(\d+), m=(\d+)[^\n]*::", doc)
    assert case, f"{name}: docstring must show the schedule for a small case ('p=4, m=8::' then rank lines)"
    p, m = int(case.group(1)), int(case.group(2))
    shown = re.findall(r"^\s*(\d+): (.+)$", doc[case.end():], flags=re.M)[:p]
    assert len(shown) == p, f"{name}: docstring shows {len(shown)} rank lines for p={p}"
    # other options on the case line (v=2, memory_limit=3, ...) that the generator takes
    # (a comma list such as forward_groups=4,2 is passed as its text)
    settings = dict(re.findall(r"(\w+)=(\d+(?:[.,]\d+)*)", case.group(0)))
    kwargs = {
        k: (x if "," in x else float(x) if "." in x else int(x))
        for k, x in settings.items() if k not in ("p", "m") and spec.accepts(k)
    }
    schedule = spec(p=p, m=m, **kwargs)
    actual = [row.split(": ", 1)[1] for row in schedule.to_text().splitlines()[1:]]  # pairs as F&BW
    assert [line.strip() for _, line in shown] == actual


@pytest.mark.sweep
@pytest.mark.parametrize("name", NAMES)
def test_validates_over_a_range(name):
    spec = schedules.get(name)
    ran = 0
    for p in (1, 2, 3, 4, 5, 8):
        for m in (1, 2, 3, 4, 5, 8, 12, 17):
            try:
                schedule = spec(p=p, m=m)
            except ScheduleError as err:
                # an unsupported (p, m) must say so with numbers, not fail obscurely
                assert re.search(r"\d", str(err)), f"{name} p={p} m={m}: {err}"
                continue
            validate(schedule)
            t = simulate(schedule)
            # a Recompute (1f1b-r) is an event of its own beside the schedule's actions
            passes = sum(1 for events in t.events for e in events if not isinstance(e.action, Recompute))
            assert passes == sum(len(a) for a in schedule.ranks)
            ran += 1
    # DualPipe takes only an even p and an even m >= 2p: 5 pairs of this grid
    assert ran >= (5 if name == "dualpipe" else 10), f"{name} supports too few (p, m) pairs"
