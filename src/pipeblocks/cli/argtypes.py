"""argparse `type=` checkers: every value from the command line is checked before anything runs.

Each checker turns the text into a value or raises `argparse.ArgumentTypeError` saying
what it wants, so `--lr nan`, `-v 0` or `--plot run.bmp` stop at parse time with exit
status 2, before a schedule is built or a process starts. NaN and infinity are bad input
everywhere: `float()` accepts "nan" and "inf", so every float checker rejects them.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from ..core.cost.costs import parse_costs
from ..core.cost.split import parse_split
from ..core.ir.errors import ScheduleError
from ..sim.plots import check_plot_suffix

__all__ = [
    "finite_float", "positive_float", "nonneg_float", "unit_float", "positive_int", "nonneg_int",
    "costs_text", "plot_file", "setting_text", "split_arg",
]


def finite_float(text: str) -> float:
    """Any finite number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def _bounded(name: str, parse: Callable[[str], float], within: Callable[[float], bool], wanted: str):
    """A checker `name`: `parse(text)`, which must be `within` bounds ('expected {wanted}')."""

    def check(text: str):
        value = parse(text)
        if not within(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    check.__name__ = check.__qualname__ = name
    return check


positive_float = _bounded("positive_float", finite_float, lambda v: v > 0, "a number > 0")
nonneg_float = _bounded("nonneg_float", finite_float, lambda v: v >= 0, "a number >= 0")
unit_float = _bounded("unit_float", finite_float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
positive_int = _bounded("positive_int", _integer, lambda v: v >= 1, "a whole number >= 1")
nonneg_int = _bounded("nonneg_int", _integer, lambda v: v >= 0, "a whole number >= 0")


def costs_text(text: str) -> str:
    """'TF,TB,TW[,TCOMM]', checked now (finite, >= 0) and kept as text for the commands."""
    try:
        parse_costs(text)
    except ScheduleError as err:  # argparse names the option already
        raise argparse.ArgumentTypeError(str(err).removeprefix("--costs ")) from None
    return text


def setting_text(text: str) -> str:
    """'KEY=VALUE' for --set; a value that reads as a number must be a finite one."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, e.g. --set cost_aware=true; got {text!r}")
    try:
        number = float(value)
    except ValueError:
        return text
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{key.strip()} must be a finite number, not {value.strip()!r}")
    return text


def split_arg(text: str) -> tuple[int, ...] | str:
    """--split N1,N2,...|auto, parsed at parse time (`core.cost.split.parse_split`); the counts are
    checked against the model and the stages when the request is built."""
    try:
        return parse_split(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def plot_file(text: str) -> str:
    """A plot's file name: its suffix picks the format, so a wrong one is caught now, not
    after the run that produces the plot."""
    try:
        check_plot_suffix(text)
    except ScheduleError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text
