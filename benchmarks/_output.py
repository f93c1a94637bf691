"""Where a benchmark's `--json` goes: a file, or standard output for `-`."""
from __future__ import annotations

import json
import sys
from typing import Any


def write_json(data: Any, target: str) -> None:
    """Write `data` as indented JSON to the file `target`, or to standard output when it is `-`."""
    text = json.dumps(data, indent=1) + "\n"
    if target == "-":
        sys.stdout.write(text)
        return
    with open(target, "w", encoding="utf-8") as handle:
        handle.write(text)
