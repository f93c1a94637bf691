"""Names a package exports but imports only on first use (PEP 562), so that importing the
package stays cheap: `from pipeblocks.models import GPTConfig` does not import torch.

    __getattr__, __dir__ = lazy_exports(__name__, {"GPT": "gpt", "ModelShape": "..core.cost.model_shape"})

Each name maps to the module that defines it, relative to the package ("gpt": its `gpt`
module; "..core.cost.model_shape": a module of a parent package).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The package's module-level `__getattr__` and `__dir__` for the names of `homes`."""

    def __getattr__(name: str) -> object:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        home = homes[name]
        return getattr(importlib.import_module(home if home.startswith(".") else f".{home}", package), name)

    def __dir__() -> list[str]:
        return sorted(homes)

    return __getattr__, __dir__
