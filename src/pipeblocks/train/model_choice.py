"""Which model a run trains, as data every process resolves alike (no torch here).

    >>> ModelChoice("llama", LlamaConfig(layers=8, kv_heads=2))        # a built-in family and its sizes
    >>> ModelChoice("hf:/data/qwen2.5-0.5b", seq=512)                  # a Hugging Face directory
    >>> ModelChoice("/home/me/my_model.py:SPEC", seq=128)              # a user's ModelSpec
    >>> choice.spec()                                                  # the pipeblocks.models.ModelSpec

A `ModelSpec` holds functions, which do not travel to the ranks of a run; its choice does,
and each rank resolves it once (`spec()`, kept on the instance). The source is one of:

    gpt, llama, hf-llama     a built-in family, sized by `config` (GPTConfig or LlamaConfig)
    hf:DIR                   the model of a Hugging Face directory, with its own weights
    FILE.py:NAME, package.module:NAME, NAME@module
                             a user's spec (`models.spec.load_spec`; a file's path absolute)

`seq` is the run's tokens per sequence (a built-in's is its config's), `dtype` the
weights' dtype (the precision's master: float32, or float64 for fp64).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.cost.model_shape import ModelShape
from ..models.config import GPTConfig
from ..models.family import get_family

__all__ = ["HF_PREFIX", "ModelChoice"]

HF_PREFIX = "hf:"
_BUILTIN = ("gpt", "llama", "hf-llama")


@dataclass(frozen=True)
class ModelChoice:
    """What is trained (see the module docstring)."""

    source: str = "gpt"
    config: Any = field(default_factory=GPTConfig)
    """the built-in family's GPTConfig or LlamaConfig (its dtype is the master dtype); None otherwise"""
    seq: int | None = None
    """tokens per sequence; None: the built-in config's"""
    dtype: str | None = None
    """the weights' dtype, "float32" or "float64"; None: the built-in config's (else float32)"""
    weights: bool = True
    """an `hf:DIR` model with its own weights (False: drawn from the seed, for a prediction of a
    directory, or a config.json, that has none)"""
    _spec: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.builtin:
            if self.config is None:
                raise ValueError(f"model family {self.source!r} needs its config (sizes)")

            family = get_family(self.source)
            if not isinstance(self.config, family.config_type):
                raise TypeError(f"the {self.source} family takes a {family.config_type.__name__}, got "
                                f"{type(self.config).__name__}")
            if self.seq is not None and self.seq != self.config.seq:
                raise ValueError(f"a built-in model's sequence is its config's ({self.config.seq}), not {self.seq}")
            if self.dtype is not None and self.dtype != self.config.dtype:
                raise ValueError(f"a built-in model's dtype is its config's ({self.config.dtype}), not {self.dtype}")
        elif self.config is not None:
            raise ValueError(f"model {self.source!r} takes its sizes from its own spec: give no built-in config")
        elif self.seq is None:
            raise ValueError(f"model {self.source!r}: give the tokens per sequence (--seq)")
        if self.dtype not in (None, "float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")

    # ---- what it is ---------------------------------------------------------------------
    @property
    def builtin(self) -> bool:
        return self.source in _BUILTIN

    @property
    def hf_directory(self) -> str | None:
        """The Hugging Face directory of an `hf:DIR` choice (None otherwise)."""
        return self.source[len(HF_PREFIX):] if self.source.startswith(HF_PREFIX) else None

    @property
    def family(self) -> str:
        """The built-in family's name, "hf" for a directory, "spec" for a user's ModelSpec."""
        return self.source if self.builtin else ("hf" if self.hf_directory is not None else "spec")

    @property
    def sequence(self) -> int:
        return self.config.seq if self.seq is None else self.seq

    @property
    def weights_dtype(self) -> str:
        if self.dtype is not None:
            return self.dtype
        return self.config.dtype if self.config is not None else "float32"

    def spec(self):
        """The `pipeblocks.models.ModelSpec` (resolved once per process; imports torch)."""
        if self._spec is None:
            object.__setattr__(self, "_spec", self._resolve())
        return self._spec

    def _resolve(self):
        if self.builtin:
            return get_family(self.source).spec(self.config)
        if self.hf_directory is not None:
            from ..models.hf import hf_spec  # torch: the command line and --dry-run never import it

            return hf_spec(self.hf_directory, weights=self.weights)
        from ..models.spec import load_spec

        return load_spec(self.source)

    @property
    def shape(self) -> ModelShape:
        return self.spec().shape

    @property
    def layers(self) -> int:
        return self.config.layers if self.config is not None else self.shape.layers

    @property
    def hidden(self) -> int:
        return self.config.hidden if self.config is not None else self.shape.hidden

    @property
    def vocab(self) -> int:
        return self.config.vocab if self.config is not None else self.shape.vocab

    def describe(self) -> str:
        """'8-layer Llama (hidden 64, 4 heads, 2 KV heads)'."""
        return self.spec().describe()

    def to_json(self) -> dict:
        if self.builtin:
            return {"family": self.source, **self.config.to_json()}
        return {"source": self.source, "seq": self.sequence, "dtype": self.weights_dtype, **self.shape.to_json()}

    def __getstate__(self) -> dict:  # the resolved spec holds functions: each process resolves its own
        return {**self.__dict__, "_spec": None}

    def __setstate__(self, state: dict) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)
