"""One registry of schedule generators, read by the CLI, the simulator, the runtime and the tests.

A generator is a pure function `(*, p, m, **options) -> Schedule`; registering it is one
decorator in its family module, and the family module is listed in `FAMILIES` below::

    @register("1f1b", "one forward, one backward; peak p on rank 0")
    def one_f_one_b(*, p: int, m: int) -> Schedule: ...

The options a generator accepts are its keyword parameters (`v`, `group_size`, `costs`,
`memory_limit`, ...); `ScheduleSpec.accepts` tells a caller which ones it may pass.
A generator with a fixed number of chunks per rank other than 1 (the V shapes: 2) says so
at registration (`v=2`), so a caller knows the stage count before building, for example
to resolve analytic costs that depend on it.
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from ..core.collector import collector_paused
from ..core.errors import ScheduleError
from ..core.schedule import Schedule

__all__ = ["ScheduleSpec", "register", "get", "names", "specs", "FAMILIES"]

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
    """Mark a generator for the registry; the family module must be listed in FAMILIES.
    `v`: its chunks per rank, when it has no `v` option of its own."""

    def mark(fn: Callable[..., Schedule]) -> Callable[..., Schedule]:
        fn.__schedule_spec__ = ScheduleSpec(name, summary, fn, v)  # type: ignore[attr-defined]
        return fn

    return mark


def _collect() -> Mapping[str, ScheduleSpec]:
    found: dict[str, ScheduleSpec] = {}
    for family in FAMILIES:
        module = importlib.import_module(f"{__package__}.{family}")
        for value in vars(module).values():
            spec = getattr(value, "__schedule_spec__", None)
            if isinstance(spec, ScheduleSpec):
                if spec.name in found and found[spec.name].build is not spec.build:
                    raise RuntimeError(f"schedule name {spec.name!r} registered twice")
                found[spec.name] = spec
    return MappingProxyType(found)


@functools.cache
def specs() -> Mapping[str, ScheduleSpec]:
    """All registered schedules by name (read-only, built once)."""
    return _collect()


def names() -> list[str]:
    return list(specs())


def get(name: str) -> ScheduleSpec:
    """The generator registered as `name`; an error listing the names otherwise."""
    try:
        return specs()[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {', '.join(names())}") from None
