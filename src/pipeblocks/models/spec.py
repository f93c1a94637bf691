"""What `pipeblocks train` needs from a model: a `ModelSpec`.

    >>> from pipeblocks.models import Layout, ModelShape, ModelSpec
    >>> SPEC = ModelSpec(
    ...     name="tiny-lm",
    ...     build=lambda: TinyLM(),                               # the whole model; its weights are not used
    ...     layout=Layout(blocks="layers", before=("embed",), after=("norm", "head")),
    ...     shape=ModelShape(layers=4, hidden=32, heads=4, vocab=256, mlp="gelu", positions="rotary"),
    ...     init=lambda seed: my_init(seed),                      # seed -> init(name, tensor)
    ... )
    $ pipeblocks train --model my_model.py:SPEC -p 2 --dp 2 --precision bf16-mixed

A spec is data about a model, and `train` asks it rather than the model's type:

    build        a function that builds the whole model (an `nn.Module`). Stages are built
                 from it with every parameter on the meta device, so it must not need its
                 parameters' values; the one-process reference of `--verify` builds it whole.
    layout       where the blocks are, and what runs before and after them (`Layout`)
    shape        its sizes, for the simulator and the memory model (`ModelShape`)
    init         `init(seed) -> init(name, tensor)`: a parameter's values from its full-model
                 name and the run's seed alone, so every rank builds the same weights
    weights      pretrained weights instead (`WeightSource`, e.g. the safetensors files of a
                 Hugging Face directory): exactly one of init and weights
    adapter      how a stage calls its parts (`BlockAdapter`; side inputs, sequence chunks)
    loss         `loss(logits, targets)`: mean next-token cross entropy by default
    tp_plan      `tp_plan() -> TPPlan` (`models.tp_plan`), or None: `--tp > 1` is refused
    export       `HFExport`: how the trained weights become a Hugging Face directory (its
                 config.json, the parameters' names there), or None: `--save-hf` is refused
    title        what progress lines call it ("Llama", "Qwen2ForCausalLM")

The model's forward maps token ids [b, s] to logits [b, s, V] (or an output object with a
`.logits`, as Hugging Face models return). `supports_sequence_chunks` is the adapter's.
A head that shares the embedding's weight (tied embeddings) is found by the splitter.

Where `train --model TEXT` finds a spec (`load_spec`): `FILE.py:NAME` (a file, imported by
path), `package.module:NAME`, or a name registered with `register_model(name, spec)` by an
imported module or by an installed package's entry point in the group "pipeblocks.models".
NAME is a ModelSpec, or a function of no arguments that returns one.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..core.cost.model_shape import ModelShape
from ..core.util.user_module import import_user_file
from .adapter import BlockAdapter
from .layout import Layout

if TYPE_CHECKING:
    from torch import Tensor, nn

    from .splitter import ParamInit, WeightSource
    from .tp_plan import TPPlan

__all__ = [
    "ENTRY_POINT_GROUP", "HFExport", "ModelSpec", "cross_entropy", "load_spec", "model_logits", "portable_reference",
    "register_model",
]

ENTRY_POINT_GROUP = "pipeblocks.models"


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy, every spec's default loss: logits [b, s, V], targets
    LongTensor [b, s]. Computed in float32 or wider: bfloat16 or float16 logits are upcast first."""
    import torch  # torch is heavy: specs are read on the torch-free command-line paths

    if logits.is_floating_point() and torch.finfo(logits.dtype).bits < 32:
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _same_name(name: str) -> str:
    return name


@dataclass(frozen=True)
class HFExport:
    """How a spec's weights are written for transformers (`pipeblocks train --save-hf`,
    `pipeblocks export --hf`)."""

    config: Callable[[], dict]
    """config.json's contents (its "architectures" names the transformers class)"""
    rename: Callable[[str], str] = _same_name
    """a parameter's full-model name -> its name in the Hugging Face checkpoint"""
    files_from: str | None = None
    """a directory whose tokenizer files and generation_config.json go with the weights"""


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """A model as `pipeblocks train` sees it (the module docstring says what each field is)."""

    name: str
    build: Callable[[], nn.Module]
    layout: Layout
    shape: ModelShape
    init: Callable[[int], ParamInit] | None = None
    weights: WeightSource | None = None
    adapter: BlockAdapter = field(default_factory=BlockAdapter)
    loss: Callable[[Tensor, Tensor], Tensor] = cross_entropy
    tp_plan: Callable[[], TPPlan] | None = None
    export: HFExport | None = None
    title: str | None = None
    float32_norms: bool = False
    """its norms compute in float32 whatever the weights' dtype (transformers' Gemma): a float64
    run that splits a norm's sums over ranks (--tp) matches one process to float32 rounding"""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("ModelSpec.name must be a non-empty string (what progress lines and errors call it)")
        if not callable(self.build):
            raise TypeError(f"ModelSpec {self.name!r}: build must be a function that returns the model, got "
                            f"{type(self.build).__name__}")
        if not isinstance(self.layout, Layout):
            raise TypeError(f"ModelSpec {self.name!r}: layout must be a pipeblocks.models.Layout, got "
                            f"{type(self.layout).__name__}")
        if not isinstance(self.shape, ModelShape):
            raise TypeError(f"ModelSpec {self.name!r}: shape must be a pipeblocks.models.ModelShape, got "
                            f"{type(self.shape).__name__}")
        if (self.init is None) == (self.weights is None):
            raise ValueError(f"ModelSpec {self.name!r} needs exactly one of init= (seed -> init(name, tensor)) and "
                             "weights= (pretrained weights)")
        if not isinstance(self.adapter, BlockAdapter):
            raise TypeError(f"ModelSpec {self.name!r}: adapter must be a BlockAdapter, got {type(self.adapter).__name__}")

    @property
    def supports_sequence_chunks(self) -> bool:
        return bool(self.adapter.supports_sequence_chunks)

    def describe(self) -> str:
        """'8-layer Llama (hidden 64, 4 heads, 2 KV heads)'."""
        s = self.shape
        kv = f", {s.num_kv_heads} KV heads" if s.num_kv_heads != s.heads else ""
        tied = ", tied embeddings" if s.tied else ""
        return f"{s.layers}-layer {self.title or self.name} (hidden {s.hidden}, {s.heads} heads{kv}{tied})"


def model_logits(output: Any) -> Tensor:
    """The logits of a model's forward: the tensor itself, or an output object's `.logits`."""
    logits = getattr(output, "logits", output)
    if logits is None or not hasattr(logits, "dim") or logits.dim() != 3:
        raise TypeError(f"the model's forward returned {type(output).__name__}: it must return logits [b, s, V] or an "
                        "object with .logits")
    return logits


# ---- finding a spec by text ---------------------------------------------------------------
_REGISTRY: dict[str, tuple[ModelSpec, str, str | None]] = {}


def register_model(name: str, spec: ModelSpec | Callable[[], ModelSpec]) -> None:
    """Make `spec` trainable as `pipeblocks train --model NAME` in this process and in the
    ranks it starts (they import the module that called this). A name registered twice by
    different modules is refused."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_model: a name is a non-empty string without ':', got {name!r}")
    caller = sys._getframe(1).f_globals
    module, file = caller.get("__name__", "__main__"), caller.get("__file__")
    held = _REGISTRY.get(name)
    # the same file imported twice (by path and by module name) registers the same spec again
    if held is not None and held[1] != module and (file is None or held[2] != file):
        raise ValueError(f"register_model: {name!r} is registered already (by {held[1]}): choose another name")
    _REGISTRY[name] = (spec, module, file)


def load_spec(text: str) -> ModelSpec:
    """The spec `--model TEXT` names: FILE.py:NAME, package.module:NAME or a registered name."""
    if not isinstance(text, str) or not text:
        raise ValueError("--model needs FILE.py:NAME, package.module:NAME or a registered model name")
    where, sep, name = text.rpartition(":")
    if not sep:
        name, at, module = text.partition("@")
        if at:  # a registered name and the module that registers it (`portable_reference`)
            _import_module(module, text)
        return _registered(name)
    if not name.isidentifier():
        raise ValueError(f"--model {text!r}: after the ':' give the name of a ModelSpec in {where!r}")
    module = _import_file(where) if where.endswith(".py") else _import_module(where, text)
    if not hasattr(module, name):
        found = sorted(k for k, v in vars(module).items() if isinstance(v, ModelSpec))
        hint = f" (it defines the ModelSpec {', '.join(found)})" if found else " (it defines no ModelSpec)"
        raise ValueError(f"--model {text!r}: {where} has no {name!r}{hint}")
    return _as_spec(getattr(module, name), text)


def portable_reference(text: str) -> str:
    """`text` as the ranks of a run resolve it: a file made absolute, a name registered in this
    process with the module that registers it ("NAME@module")."""
    where, sep, name = text.rpartition(":")
    if sep and where.endswith(".py"):
        return f"{Path(where).expanduser().resolve()}:{name}"
    if not sep and "@" not in text and text in _REGISTRY and _REGISTRY[text][1] != "__main__":
        return f"{text}@{_REGISTRY[text][1]}"
    return text


def _registered(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        for entry in _entry_points():
            if entry.name == name:
                return _as_spec(entry.load(), f"entry point {entry.value}")
        known = sorted(set(_REGISTRY) | {e.name for e in _entry_points()})
        raise ValueError(
            f"--model {name!r}: no model is registered by that name ({', '.join(known) or 'none registered'}); give "
            "FILE.py:NAME or package.module:NAME of a ModelSpec (docs/your-model.md), or --hf DIR"
        )
    return _as_spec(_REGISTRY[name][0], name)


def _entry_points() -> list:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _as_spec(value: Any, text: str) -> ModelSpec:
    if not isinstance(value, ModelSpec) and callable(value) and not isinstance(value, type):
        value = value()
    if not isinstance(value, ModelSpec):
        raise ValueError(f"--model {text!r} is a {type(value).__name__}, not a ModelSpec: give the name of a "
                         "pipeblocks.models.ModelSpec (or of a function returning one)")
    return value


def _import_file(path: str):
    try:
        return import_user_file(path, prefix="pipeblocks_user_model")
    except FileNotFoundError:
        raise ValueError(f"--model: no file {path!r}: give FILE.py:NAME with an existing Python file") from None


def _import_module(name: str, text: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        raise ValueError(f"--model {text!r}: cannot import {name!r} ({err}): give FILE.py:NAME or an importable "
                         "package.module:NAME") from None
