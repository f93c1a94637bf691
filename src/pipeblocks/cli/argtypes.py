"""argparse `type=` checkers: every value from the command line is checked before anything runs.

Each checker turns the text into a value or raises `argparse.ArgumentTypeError` saying
what it wants, so `--lr nan`, `-v 0` or `--plot run.bmp` stop at parse time with exit
status 2, before a schedule is built or a process starts. NaN and infinity are bad input
everywhere: `float()` accepts "nan" and "inf", so every float checker rejects them.
"""
from __future__ import annotations

import argparse
import math

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


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def unit_float(text: str) -> float:
    """A finite number in [0, 1] (a share)."""
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def nonneg_int(text: str) -> int:
    """A whole number >= 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


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
