"""Tensor specs (shape and dtype) of the activations that cross between stages.

A receiver must allocate its buffer before the data arrives, so the executor learns every
activation's spec once, on the first step, with a shape pass: stage by stage in global
order, each rank takes the specs of its stage's inputs (from the step's inputs on stage
0, from a small metadata message otherwise), infers the output specs by running the stage
on the "meta" device (no compute, no RNG use; a real no-grad probe on zeros if the module
cannot run on meta), and sends them on. Stages are visited in increasing order on every
rank, so the pass cannot deadlock. A stage that cannot take its predecessor's output
fails here, before any real compute, with both specs in the message.

Input gradients have the spec of the activation they belong to, so they need no message.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
from torch.func import functional_call

__all__ = ["TensorSpec", "SpecMismatchError", "infer_output_spec", "encode_specs", "decode_specs", "MAX_DIMS"]

MAX_DIMS = 8
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)


class SpecMismatchError(ValueError):
    """A stage cannot take the tensor its predecessor produces (or shapes changed after step 1)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(tensor.shape), tensor.dtype)

    def empty(self, device: torch.device | str) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[{', '.join(map(str, self.shape))}]"


def infer_output_spec(module: torch.nn.Module, spec: TensorSpec, device: torch.device) -> TensorSpec:
    """The spec of `module(x)` for an input of `spec`, computed on the meta device if possible.

    Raises SpecMismatchError with the input spec when the module cannot take it.
    """
    try:
        return _on_meta(module, spec)
    except Exception:  # noqa: BLE001 - modules that cannot run on meta get a real probe
        pass
    try:
        return _probe(module, spec, device)
    except Exception as err:  # noqa: BLE001 - reported with the specs
        raise SpecMismatchError(f"cannot take an input of {spec}: {type(err).__name__}: {err}") from err


def _on_meta(module: torch.nn.Module, spec: TensorSpec) -> TensorSpec:
    state = {name: torch.empty_like(t, device="meta") for name, t in module.named_parameters()}
    state.update({name: torch.empty_like(t, device="meta") for name, t in module.named_buffers()})
    with torch.no_grad():
        out = functional_call(module, state, (torch.empty(spec.shape, dtype=spec.dtype, device="meta"),))
    return _check_output(out)


def _probe(module: torch.nn.Module, spec: TensorSpec, device: torch.device) -> TensorSpec:
    devices = [device] if device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type), torch.no_grad():
        out = module(torch.zeros(spec.shape, dtype=spec.dtype, device=device))
    return _check_output(out)


def _check_output(out: object) -> TensorSpec:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"a stage module must return one tensor, got {type(out).__name__}")
    return TensorSpec.of(out)


def encode_specs(specs: list[TensorSpec]) -> torch.Tensor:
    """One int64 row per spec: dtype code, ndim, dims (padded)."""
    rows = torch.zeros((len(specs), 2 + MAX_DIMS), dtype=torch.int64)
    for i, spec in enumerate(specs):
        if len(spec.shape) > MAX_DIMS:
            raise ValueError(f"activation {spec} has {len(spec.shape)} dims; at most {MAX_DIMS} can cross between stages")
        if spec.dtype not in _DTYPES:
            raise ValueError(f"activation dtype {spec.dtype} cannot cross between stages; use one of {_DTYPES}")
        rows[i, 0] = _DTYPES.index(spec.dtype)
        rows[i, 1] = len(spec.shape)
        rows[i, 2 : 2 + len(spec.shape)] = torch.tensor(spec.shape, dtype=torch.int64)
    return rows


def decode_specs(rows: torch.Tensor) -> list[TensorSpec]:
    out = []
    for row in rows.tolist():
        ndim = row[1]
        out.append(TensorSpec(tuple(row[2 : 2 + ndim]), _DTYPES[row[0]]))
    return out
