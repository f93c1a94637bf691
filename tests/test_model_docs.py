"""docs/your-model.md: its first Python example runs as written and checks itself."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "your-model.md"


def test_first_python_example_runs(capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    assert blocks, f"{DOC.name} has no ```python block"
    exec(compile(blocks[0], str(DOC), "exec"), {"__name__": "your_model_example"})
    out = capsys.readouterr().out
    assert "[range(0, 2), range(2, 4)]" in out and "['head.bias', 'head.weight']" in out
