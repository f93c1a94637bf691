"""What crosses between stages: activations (a tensor, or a tuple or dict of tensors), their
specs (shapes and dtypes), and how a stage is called with them.

An activation is a tensor, a tuple of activations or a dict (str keys) of activations: one
level in practice, nesting allowed. `flatten` splits it into a `Layout` (the structure)
and its leaves (tensors, in order); `Layout.build` puts it back. Its spec,
`ActivationSpec`, is the layout and one `TensorSpec` per leaf. Each leaf crosses as its
own message. A stage receives an activation as `call_stage` passes it: a tensor as the
one argument, a tuple as positional arguments, a dict as keyword arguments; side inputs
and the sequence chunk come as keyword arguments beside it.

Gradients. Only floating leaves carry one. The gradient of an activation is a tensor when
the activation is one floating tensor, else a tuple with one tensor per floating leaf, in
leaf order (empty when no leaf floats); `ActivationSpec.gradient` is its spec.

A receiver must allocate its buffers before the data arrives, so the executor learns every
activation's spec once, on the first step, with a shape pass: stage by stage in global
order, each rank takes the specs of its stage's inputs (from the step's inputs on stage
0, from a small metadata message otherwise), infers the output specs by running the stage
on the "meta" device (no compute, no RNG use; a real no-grad probe on zeros if the module
cannot run on meta), and sends them on. Stages are visited in increasing order on every
rank, so the pass cannot deadlock. A stage that cannot take its predecessor's output
fails here, before any real compute, with both specs in the message.

The metadata message is a flat int64 stream (`encode_specs`), one activation after the
other in preorder: a tensor is `0, dtype, ndim, dims...`; a tuple `1, n` and its n
items; a dict `2, n` and per entry its key (`length, UTF-8 bytes...`) and its value.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call

__all__ = [
    "ActivationSpec", "Layout", "SpecMismatchError", "TensorSpec", "TENSOR", "activation_spec", "call_stage",
    "decode_specs", "encode_specs", "flatten", "floating_leaves", "infer_output_spec", "leaves_of", "stage_arguments",
    "zero_gradient",
]

_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_TENSOR, _TUPLE, _DICT = 0, 1, 2  # node codes of the metadata stream
_MAX_KEY_BYTES = 256
_MAX_DIMS = 64


class SpecMismatchError(ValueError):
    """A stage cannot take the activation its predecessor produces, or an activation's shape
    or dtype changed after the shape pass of the first step."""


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


@dataclass(frozen=True)
class Layout:
    """The structure of an activation: "tensor" (one leaf), "tuple" (children in order) or
    "dict" (`keys`, and a child per key)."""

    kind: str = "tensor"
    keys: tuple[str, ...] = ()
    children: tuple[Layout, ...] = ()

    @property
    def size(self) -> int:
        """Number of leaves."""
        return 1 if self.kind == "tensor" else sum(child.size for child in self.children)

    def paths(self, name: str = "output") -> list[str]:
        """Each leaf's name in error messages: `output`, `output[1]`, `output['mask']`."""
        if self.kind == "tensor":
            return [name]
        labels = [f"[{key!r}]" for key in self.keys] if self.kind == "dict" else [f"[{i}]" for i in range(len(self.children))]
        return [path for label, child in zip(labels, self.children) for path in child.paths(name + label)]

    def build(self, leaves: Sequence[Any]) -> Any:
        """The activation of this layout with `leaves` in leaf order."""
        if self.kind == "tensor":
            return leaves[0]
        return self._build(iter(leaves))

    def _build(self, items) -> Any:
        if self.kind == "tensor":
            return next(items)
        values = [child._build(items) for child in self.children]
        return dict(zip(self.keys, values)) if self.kind == "dict" else tuple(values)


TENSOR = Layout()


def flatten(value: Any, what: str = "the activation") -> tuple[Layout, list[torch.Tensor]]:
    """(layout, leaves) of an activation; TypeError, naming `what`, for anything else."""
    if isinstance(value, torch.Tensor):
        return TENSOR, [value]
    leaves: list[torch.Tensor] = []
    return _flatten(value, what, "", leaves), leaves


def _flatten(value: Any, what: str, path: str, leaves: list[torch.Tensor]) -> Layout:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return TENSOR
    where = f"{what}{path}"
    if isinstance(value, tuple) and value:
        return Layout("tuple", (), tuple(_flatten(v, what, f"{path}[{i}]", leaves) for i, v in enumerate(value)))
    if isinstance(value, Mapping) and value:
        bad = [key for key in value if not isinstance(key, str)]
        if bad:
            raise TypeError(f"{where} is a dict with key {bad[0]!r}; keys of activations must be str")
        return Layout("dict", tuple(value), tuple(_flatten(v, what, f"{path}[{k!r}]", leaves) for k, v in value.items()))
    empty = " (empty)" if isinstance(value, (tuple, Mapping)) else ""
    hint = "; return a tuple, not a list" if isinstance(value, list) else ""
    raise TypeError(
        f"{where} is {type(value).__name__}{empty}: an activation must be a tensor, or a non-empty tuple or dict "
        f"(str keys) of tensors{hint}"
    )


def leaves_of(value: Any) -> list[torch.Tensor]:
    """The leaves of an activation, or of a gradient (a tensor or a tuple of tensors)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple) and not value:
        return []  # the gradient of an activation without floating leaves
    return flatten(value)[1]


def floating_leaves(value: Any) -> list[torch.Tensor]:
    """The leaves that carry a gradient."""
    return [t for t in leaves_of(value) if t.is_floating_point()]


def zero_gradient(value: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A zero gradient of the activation `value` (see the module doc for its form)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return torch.zeros_like(value)
    return tuple(torch.zeros_like(t) for t in floating_leaves(value))


@dataclass(frozen=True)
class ActivationSpec:
    """Spec of an activation: its layout and one TensorSpec per leaf."""

    layout: Layout
    leaves: tuple[TensorSpec, ...]

    @staticmethod
    def of(value: Any, what: str = "the activation") -> ActivationSpec:
        layout, leaves = flatten(value, what)
        return ActivationSpec(layout, tuple(TensorSpec.of(t) for t in leaves))

    def empty(self, device: torch.device | str) -> Any:
        return self.layout.build([leaf.empty(device) for leaf in self.leaves])

    def gradient(self) -> ActivationSpec:
        """The spec of this activation's gradient (its floating leaves)."""
        if self.layout.kind == "tensor" and self.leaves[0].dtype.is_floating_point:
            return self
        floating = tuple(leaf for leaf in self.leaves if leaf.dtype.is_floating_point)
        return ActivationSpec(Layout("tuple", (), (TENSOR,) * len(floating)), floating)

    def mismatch(self, value: Any, name: str = "output") -> tuple[str, str, str] | None:
        """None if `value` has this spec, else (path, what it is, what was expected) of the
        first difference: a leaf (`output[1]`), or the whole value when its structure differs."""
        try:
            got = ActivationSpec.of(value, name)
        except TypeError as err:
            return name, f"not an activation ({err})", str(self)
        if got == self:
            return None
        if got.layout != self.layout:
            return name, str(got), str(self)
        for path, have, want in zip(self.layout.paths(name), got.leaves, self.leaves):
            if have != want:
                return path, str(have), str(want)
        return None

    def __str__(self) -> str:
        return _format(self.layout, iter(self.leaves))


def activation_spec(spec: ActivationSpec | TensorSpec) -> ActivationSpec:
    """An ActivationSpec; a TensorSpec is the spec of one tensor."""
    return spec if isinstance(spec, ActivationSpec) else ActivationSpec(TENSOR, (spec,))


def _format(layout: Layout, leaves) -> str:
    if layout.kind == "tensor":
        return str(next(leaves))
    items = [_format(child, leaves) for child in layout.children]
    if layout.kind == "dict":
        return "{" + ", ".join(f"{key!r}: {item}" for key, item in zip(layout.keys, items)) + "}"
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


# ---- calling a stage --------------------------------------------------------------------------
def stage_arguments(x: Any, side: Mapping[str, Any] | None = None, chunk: object | None = None) -> tuple[tuple, dict]:
    """(args, kwargs) a stage is called with: `x` as one argument (a tensor), positional
    arguments (a tuple) or keyword arguments (a dict); side inputs and `chunk` as keywords."""
    kwargs: dict[str, Any] = dict(side) if side else {}
    if chunk is not None:
        kwargs["chunk"] = chunk
    if isinstance(x, tuple):
        return x, kwargs
    if isinstance(x, dict):
        clash = sorted(set(x) & set(kwargs))
        if clash:
            raise ValueError(
                f"the stage input has key {clash[0]!r}, which is also the name of a side input or `chunk`: "
                "rename one of them (both are passed as keyword arguments)"
            )
        return (), {**x, **kwargs}
    return (x,), kwargs


def call_stage(module: torch.nn.Module, x: Any, side: Mapping[str, Any] | None = None,
               chunk: object | None = None) -> Any:
    """Run a stage on activation `x` (see `stage_arguments`)."""
    if side is None and chunk is None and isinstance(x, torch.Tensor):
        return module(x)
    args, kwargs = stage_arguments(x, side, chunk)
    return module(*args, **kwargs)


# ---- the shape pass -------------------------------------------------------------------------
def infer_output_spec(module: torch.nn.Module, spec: ActivationSpec | TensorSpec, device: torch.device,
                      side: Mapping[str, Any] | None = None) -> ActivationSpec:
    """The spec of the module's output for an input of `spec` (and these side inputs), computed
    on the meta device if possible.

    Raises SpecMismatchError with the input spec when the module cannot take it, and
    TypeError when it returns something that is not an activation.
    """
    spec = activation_spec(spec)
    try:
        out = _on_meta(module, spec, side)
    except Exception:  # noqa: BLE001 - modules that cannot run on meta get a real probe
        try:
            out = _probe(module, spec, device, side)
        except Exception as err:  # noqa: BLE001 - reported with the specs
            raise SpecMismatchError(f"cannot take an input of {spec}: {type(err).__name__}: {err}") from err
    return ActivationSpec.of(out, "the stage's output")


def _on_meta(module: torch.nn.Module, spec: ActivationSpec, side: Mapping[str, Any] | None) -> Any:
    state = {name: torch.empty_like(t, device="meta") for name, t in module.named_parameters()}
    state.update({name: torch.empty_like(t, device="meta") for name, t in module.named_buffers()})
    x = spec.layout.build([torch.empty(leaf.shape, dtype=leaf.dtype, device="meta") for leaf in spec.leaves])
    meta_side = {k: torch.empty_like(v, device="meta") if isinstance(v, torch.Tensor) else v
                 for k, v in (side or {}).items()}
    args, kwargs = stage_arguments(x, meta_side)
    with torch.no_grad():
        return functional_call(module, state, args, kwargs)


def _probe(module: torch.nn.Module, spec: ActivationSpec, device: torch.device,
           side: Mapping[str, Any] | None) -> Any:
    devices = [device] if device.type != "cpu" else []
    x = spec.layout.build([torch.zeros(leaf.shape, dtype=leaf.dtype, device=device) for leaf in spec.leaves])
    with torch.random.fork_rng(devices=devices, device_type=device.type), torch.no_grad():
        return call_stage(module, x, side)


def encode_specs(specs: Sequence[ActivationSpec | TensorSpec]) -> torch.Tensor:
    """The metadata stream of `specs` (see the module doc): a 1-D int64 tensor."""
    stream: list[int] = []
    for spec in specs:
        spec = activation_spec(spec)
        _encode(spec.layout, iter(spec.leaves), stream)
    return torch.tensor(stream, dtype=torch.int64)


def _encode(layout: Layout, leaves, stream: list[int]) -> None:
    if layout.kind == "tensor":
        spec = next(leaves)
        if spec.dtype not in _DTYPES:
            raise ValueError(f"activation dtype {spec.dtype} cannot cross between stages; use one of {_DTYPES}")
        if len(spec.shape) > _MAX_DIMS:
            raise ValueError(f"activation {spec} has {len(spec.shape)} dims; at most {_MAX_DIMS} can cross")
        stream += [_TENSOR, _DTYPES.index(spec.dtype), len(spec.shape), *spec.shape]
        return
    stream += [_TUPLE if layout.kind == "tuple" else _DICT, len(layout.children)]
    for i, child in enumerate(layout.children):
        if layout.kind == "dict":
            key = layout.keys[i].encode()
            if len(key) > _MAX_KEY_BYTES:
                raise ValueError(f"activation key {layout.keys[i][:40]!r}... has {len(key)} bytes; at most "
                                 f"{_MAX_KEY_BYTES} can cross: use a shorter key")
            stream += [len(key), *key]
        _encode(child, leaves, stream)


def decode_specs(stream: torch.Tensor) -> list[ActivationSpec]:
    """The specs of a metadata stream, in order."""
    values = stream.tolist()
    position = 0
    out = []
    while position < len(values):
        leaves: list[TensorSpec] = []
        layout, position = _decode(values, position, leaves)
        out.append(ActivationSpec(layout, tuple(leaves)))
    return out


def _decode(values: list[int], at: int, leaves: list[TensorSpec]) -> tuple[Layout, int]:
    code = values[at]
    if code == _TENSOR:
        ndim = values[at + 2]
        leaves.append(TensorSpec(tuple(values[at + 3:at + 3 + ndim]), _DTYPES[values[at + 1]]))
        return TENSOR, at + 3 + ndim
    count, at = values[at + 1], at + 2
    keys, children = [], []
    for _ in range(count):
        if code == _DICT:
            length = values[at]
            keys.append(bytes(values[at + 1:at + 1 + length]).decode())
            at += 1 + length
        child, at = _decode(values, at, leaves)
        children.append(child)
    return Layout("dict" if code == _DICT else "tuple", tuple(keys), tuple(children)), at
