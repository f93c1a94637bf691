"""A schedule generator from a module outside the package: `register` in the user's module,
`--schedules-from MODULE` on any command (or `load_schedules`), or an installed package's
entry point in the group "pipeblocks.schedules"; then it is simulated by name like any other."""
from __future__ import annotations

import textwrap

import pytest

from pipeblocks.cli.main import main
from pipeblocks.core.ir.errors import ScheduleError
from pipeblocks.schedules import registry

MODULE = '''
from pipeblocks.core import Action, Kind, Placement, Schedule
from pipeblocks.schedules import register


@register("{name}", "all forwards, then all fused backwards, written outside pipeblocks")
def mine(*, p: int, m: int) -> Schedule:
    """GPipe's order (p=2, m=2)::

        rank 0  0F0 0F1 .   .   0BW1 0BW0
    """
    ranks = [[Action(r, Kind.F, i) for i in range(m)] + [Action(r, Kind.BW, i) for i in reversed(range(m))]
             for r in range(p)]
    return Schedule("{name}", p, m, Placement.loop(p), tuple(tuple(a) for a in ranks))
'''


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch):
    """Schedules a test registers stay in that test."""
    monkeypatch.setattr(registry, "_USER", {})
    monkeypatch.setattr(registry, "_USER_FROM", {})


def _module(tmp_path, name="mine-gpipe", file="my_schedules.py"):
    path = tmp_path / file
    path.write_text(textwrap.dedent(MODULE.format(name=name)))
    return path


def test_a_generator_from_a_users_file_is_simulated_by_name(tmp_path, capsys):
    path = _module(tmp_path)
    assert main(["simulate", "mine-gpipe", "-p", "2", "-m", "4", "--schedules-from", str(path)]) == 0
    mine = capsys.readouterr().out
    assert main(["simulate", "gpipe", "-p", "2", "-m", "4"]) == 0
    gpipe = capsys.readouterr().out
    # the same order as the built-in GPipe: the same timeline and figures, under its own name
    assert "mine-gpipe" in mine and mine.replace("mine-gpipe", "gpipe") == gpipe
    assert registry.get("mine-gpipe")(p=2, m=4).name == "mine-gpipe"
    # before the command too, and `list` shows it
    assert main(["--schedules-from", str(path), "list"]) == 0
    assert "mine-gpipe" in capsys.readouterr().out


def test_without_the_module_the_name_is_unknown_and_says_how(capsys):
    assert main(["simulate", "mine-gpipe", "-p", "2", "-m", "4"]) == 2
    assert "unknown schedule 'mine-gpipe'" in capsys.readouterr().err


@pytest.mark.parametrize("case, says", [
    ("builtin-name", r"schedule name '1f1b' is registered twice: by pipeblocks.schedules.classic and by .*another name"),
    ("missing", r"--schedules-from '.*nowhere.py': cannot import it"),
    ("empty", r"it registers no schedule: mark a generator with @pipeblocks.schedules.register"),
])
def test_a_bad_module_is_one_clear_line(tmp_path, capsys, case, says):
    import re

    path = {"builtin-name": lambda: _module(tmp_path, name="1f1b"), "missing": lambda: tmp_path / "nowhere.py",
            "empty": lambda: (tmp_path / "empty.py", (tmp_path / "empty.py").write_text("x = 1\n"))[0]}[case]()
    assert main(["simulate", "1f1b", "-p", "2", "-m", "4", "--schedules-from", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.search(says, err) and err.count("\n") == 1, err
    with pytest.raises(ScheduleError):
        registry.load_schedules(str(path))


def test_an_installed_packages_entry_point_registers_its_module(tmp_path, monkeypatch):
    import importlib.metadata
    import sys

    _module(tmp_path, name="installed-gpipe", file="their_schedules.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = importlib.metadata.EntryPoint("theirs", "their_schedules", registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [entry] if group == registry.ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(registry, "_ENTRY_POINTS_READ", False)
    monkeypatch.delitem(sys.modules, "their_schedules", raising=False)
    assert "installed-gpipe" in registry.names()
    assert registry.get("installed-gpipe")(p=2, m=2).ranks[0][-1].microbatch == 0
