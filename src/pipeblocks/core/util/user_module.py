"""Importing a user's module by a file path or a module name (torch-free).

    >>> module = import_user_file("my_schedules.py", prefix="pipeblocks_user_schedules")
    >>> module = import_user_module("mypackage.schedules")

Both `--model FILE.py:NAME` (`models.spec`) and `--schedules-from MODULE`
(`schedules.registry`) name code that lives outside pipeblocks. A file is imported once per
process under a name made from its absolute path, so naming it twice (or by a relative and
an absolute path) runs it once.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["import_user_file", "import_user_module"]


def import_user_file(path: str | Path, *, prefix: str) -> ModuleType:
    """The module of Python file `path` (FileNotFoundError when there is no such file)."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"no file {str(path)!r}")
    module_name = f"{prefix}_{abs(hash(str(file))):x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def import_user_module(source: str, *, prefix: str = "pipeblocks_user") -> ModuleType:
    """A `.py` file's module, or the importable module named `source` (ModuleNotFoundError or
    FileNotFoundError otherwise)."""
    if source.endswith(".py"):
        return import_user_file(source, prefix=prefix)
    return importlib.import_module(source)
