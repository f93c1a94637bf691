"""JSON that other tools can read.

Python's `json` writes NaN and Infinity, which JSON does not have (strict readers reject
the whole document), so a non-finite float is written as null.
"""
from __future__ import annotations

import json
import math

__all__ = ["json_text"]


def json_text(data: object, *, indent: int | None = 2) -> str:
    """`json.dumps` that never writes NaN or Infinity: a non-finite float becomes null."""
    return json.dumps(_finite(data), indent=indent, allow_nan=False)


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
