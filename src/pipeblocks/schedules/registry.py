"""One registry of schedule generators, read by the CLI, the simulator, the runtime and the tests.

A generator is a pure function `(*, p, m, **options) -> Schedule`; registering it is one
decorator::

    @register("1f1b", "one forward, one backward; peak p on rank 0")
    def one_f_one_b(*, p: int, m: int) -> Schedule: ...

The registry finds generators in three places: the family modules of this package
(`FAMILIES`), a user's own module (`load_schedules("my_schedules.py")`, which
`pipeblocks --schedules-from my_schedules.py simulate NAME` calls), and the modules that
installed packages name under the entry-point group "pipeblocks.schedules" (imported the
first time the registry is read). A name is registered once: a user's generator cannot take
a built-in's name.

The options a generator accepts are its keyword parameters (`v`, `group_size`, `costs`,
`memory_limit`, ...); `ScheduleSpec.accepts` tells a caller which ones it may pass.
A generator with a fixed number of chunks per rank other than 1 (the V shapes: 2) says so
at registration (`v=2`), so a caller knows the stage count before building, for example
to resolve analytic costs that depend on it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from ..core.ir.errors import ScheduleError
from ..core.ir.schedule import Schedule
from ..core.simulator.collector import collector_paused
from ..core.util.user_module import import_user_module

__all__ = ["ScheduleSpec", "register", "get", "names", "specs", "load_schedules", "FAMILIES", "ENTRY_POINT_GROUP"]

ENTRY_POINT_GROUP = "pipeblocks.schedules"
"""installed packages name their schedule modules here (pyproject: [project.entry-points."pipeblocks.schedules"])"""

# Family modules, in the order `pipeblocks list` shows them.
FAMILIES = ("classic", "looped", "elastic", "zero_bubble", "vshape", "vadaptive", "zb_greedy", "zbv", "dualpipe", "sequence")


@dataclass(frozen=True)
class ScheduleSpec:
    """A registered generator. Calling the spec calls the generator."""

    name: str
    summary: str
    build: Callable[..., Schedule]
    v: int = 1
    """chunks per rank when the generator has no `v` option"""

    def __call__(self, **kwargs) -> Schedule:
        unknown = sorted(set(kwargs) - self.parameters)
        if unknown:
            raise ScheduleError(
                f"schedule {self.name!r} does not take option(s) {unknown}; it takes {sorted(self.parameters)}"
            )
        for key in ("p", "m"):
            value = kwargs.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{key} must be an integer >= 1, got {value!r}")
        with collector_paused():
            return self.build(**kwargs)

    @property
    def parameters(self) -> frozenset[str]:
        return frozenset(inspect.signature(self.build).parameters)

    def num_stages(self, **kwargs) -> int:
        """The stage count the generator builds for these options, without building:
        p times its `v` option (given, or the parameter's default), or the registered v."""
        p = kwargs["p"]
        parameter = inspect.signature(self.build).parameters.get("v")
        if parameter is None:
            return p * self.v
        v = kwargs.get("v")
        return p * (parameter.default if v is None else v)

    def accepts(self, option: str) -> bool:
        return option in self.parameters

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.build) or self.summary


def register(name: str, summary: str, *, v: int = 1) -> Callable[[Callable[..., Schedule]], Callable[..., Schedule]]:
    """Mark a generator for the registry (the module holding it is found through FAMILIES,
    `load_schedules` or an entry point). `v`: its chunks per rank, when it has no `v` option
    of its own."""

    def mark(fn: Callable[..., Schedule]) -> Callable[..., Schedule]:
        fn.__schedule_spec__ = ScheduleSpec(name, summary, fn, v)  # type: ignore[attr-defined]
        return fn

    return mark


def _marked(module, found: dict[str, ScheduleSpec], where: Mapping[str, str]) -> list[str]:
    """Add the generators `module` marks with `register` to `found`; their names."""
    added = []
    for value in vars(module).values():
        spec = getattr(value, "__schedule_spec__", None)
        if isinstance(spec, ScheduleSpec):
            held = found.get(spec.name)
            if held is not None and held.build is not spec.build:
                raise ScheduleError(f"schedule name {spec.name!r} is registered twice: by "
                                    f"{where.get(spec.name, held.build.__module__)} and by {module.__name__}; "
                                    "give one of them another name")
            found[spec.name] = spec
            added.append(spec.name)
    return added


@functools.cache
def _builtin() -> Mapping[str, ScheduleSpec]:
    found: dict[str, ScheduleSpec] = {}
    for family in FAMILIES:
        _marked(importlib.import_module(f"{__package__}.{family}"), found, {})
    return MappingProxyType(found)


_USER: dict[str, ScheduleSpec] = {}
_USER_FROM: dict[str, str] = {}  # name -> the source that registered it
_ENTRY_POINTS_READ = False


def load_schedules(source: str) -> tuple[str, ...]:
    """Import a user's module (a `.py` file or an importable module name) and register the
    generators it marks with `register`; their names. Loading the same module again is a no-op."""
    try:
        module = import_user_module(source, prefix="pipeblocks_user_schedules")
    except (FileNotFoundError, ModuleNotFoundError) as err:
        raise ScheduleError(f"--schedules-from {source!r}: cannot import it ({err}): give a .py file or an importable "
                            "module that defines generators marked with pipeblocks.schedules.register") from None
    found = {**specs()}
    where = dict(_USER_FROM)  # a built-in is named by its module (`_marked`)
    added = _marked(module, found, where)
    if not added:
        raise ScheduleError(f"--schedules-from {source!r}: it registers no schedule: mark a generator with "
                            "@pipeblocks.schedules.register(NAME, SUMMARY) (docs/schedules.md, 'Adding a schedule')")
    for name in added:
        _USER[name], _USER_FROM[name] = found[name], source
    return tuple(added)


def _read_entry_points() -> None:
    global _ENTRY_POINTS_READ
    if _ENTRY_POINTS_READ:
        return
    _ENTRY_POINTS_READ = True  # before loading: a module that reads the registry as it loads
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        load_schedules(entry.value.partition(":")[0])


def specs() -> Mapping[str, ScheduleSpec]:
    """All registered schedules by name (read-only): the built-in families', then the
    entry points' and those `load_schedules` added."""
    _read_entry_points()
    if not _USER:
        return _builtin()
    return MappingProxyType({**_builtin(), **_USER})


def names() -> list[str]:
    return list(specs())


def get(name: str) -> ScheduleSpec:
    """The generator registered as `name`; an error listing the names otherwise."""
    try:
        return specs()[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(names())} (a schedule of your "
                            "own: --schedules-from MODULE, docs/schedules.md)") from None
