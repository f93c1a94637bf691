"""A model directory's safetensors weights, read one tensor (or one slice of it) at a time.

    >>> weights = SafetensorsWeights("path/to/model")      # model.safetensors, or an index and shards
    >>> weights.read("model.layers.3.mlp.up_proj.weight", (11008, 4096))               # the whole tensor
    >>> weights.read("lm_head.weight", (32000, 4096), (slice(0, 16000), slice(0, 4096)))  # one TP rank's rows

The files are memory-mapped by safetensors and only the tensors (or slices) asked for are
read, so a pipeline rank reads its own stages' weights and, under tensor parallelism, only
its shards of them: no rank ever holds the whole model. A tensor comes back as a CPU
tensor in its stored dtype; the caller casts it to the precision asked.

Refused, one line each: a directory without weights; one with only pickled
`pytorch_model.bin` files (unpickling runs code: the message gives the command that
converts them to safetensors); an index that names a missing shard; a tensor the model
needs that the files lack, or one with another shape (both shapes named).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import Tensor

__all__ = ["INDEX", "SINGLE", "SafetensorsWeights", "find_weights"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def find_weights(directory: str | Path) -> dict[str, str]:
    """{tensor name: the safetensors file (in `directory`) that holds it}."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"cannot read {str(index)!r} (a safetensors index with a weight_map): {err}") from None
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise ValueError(f"{str(index)!r} names {', '.join(missing[:3])}, which {str(directory)!r} lacks: copy the "
                             "missing shards into the directory")
        return {name: str(directory / f) for name, f in weight_map.items()}
    single = directory / SINGLE
    if single.is_file():
        from safetensors import safe_open  # optional (the hf extra)

        with safe_open(str(single), framework="pt") as handle:
            return {name: str(single) for name in handle.keys()}
    pickled = sorted(p.name for p in directory.glob("pytorch_model*.bin"))
    if pickled:
        raise ValueError(
            f"{str(directory)!r} holds only pickled weights ({', '.join(pickled[:2])}), which pipeblocks does not load "
            "(unpickling runs code). Convert them once where you trust the files: python -c \"import transformers; "
            f"m = transformers.AutoModelForCausalLM.from_pretrained('{directory}'); m.save_pretrained('{directory}', "
            "safe_serialization=True)\""
        )
    raise ValueError(f"{str(directory)!r} holds no weights ({SINGLE}, or {INDEX} with its shards): give a directory "
                     "written by save_pretrained")


class SafetensorsWeights:
    """The tensors of a directory's safetensors files, by name (see the module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = str(directory)
        self.files = find_weights(directory)
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, shape: tuple[int, ...], region: tuple[slice, ...] | None = None) -> Tensor:
        """The tensor `name`, which must have `shape`, or only its `region` (a tuple of slices)."""
        view = self._slice(name)
        stored = tuple(view.get_shape())
        if stored != tuple(shape):
            raise ValueError(f"tensor {name} has shape {list(stored)} in {self.files[name]}, but the model (its "
                             f"config.json) expects {list(shape)}: the weights and config.json disagree")
        if region is None:
            return self._handles[self.files[name]].get_tensor(name)
        return view[region]

    def _slice(self, name: str):
        file = self.files.get(name)
        if file is None:
            raise ValueError(f"the safetensors files of {self.directory!r} lack the tensor {name}, which the model needs: "
                             "the weights and config.json do not belong together")
        handle = self._handles.get(file)
        if handle is None:
            from safetensors import safe_open  # optional (the hf extra)

            handle = self._handles[file] = safe_open(file, framework="pt", device="cpu")
        return handle.get_slice(name)

    def __getstate__(self) -> dict:  # handles stay in their process
        return {"directory": self.directory, "files": self.files, "_handles": {}}

    def __repr__(self) -> str:
        return f"SafetensorsWeights({self.directory!r}, {len(self.files)} tensors)"
