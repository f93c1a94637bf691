"""Training precision as a policy: which dtype the weights are kept in, which one computes,
and which one gradients are reduced in. No torch here: the cost model prices the same
bytes the runtime holds.

    >>> policy = precision_policy("bf16-mixed")
    >>> policy.master, policy.compute, policy.reduce
    ('float32', 'bfloat16', 'float32')
    >>> policy.master_bytes, policy.compute_bytes, policy.grad_bytes, policy.optimizer_bytes
    (4, 2, 4, 8)

The three policies `pipeblocks train --precision` takes:

    fp32        weights, activations, gradients and AdamW state in float32
    fp64        the same in float64 (exactness checks: 1e-10)
    bf16-mixed  float32 master weights and AdamW state; each step computes with a bfloat16
                copy of the weights, so activations and the tensors that cross between
                stages are bfloat16; gradients accumulate over the microbatches in float32
                (into the master weights' .grad) and are reduced in float32; the loss is
                computed in float32

Bytes per parameter a rank holds under bf16-mixed without sharding: master 4 + compute copy
2 (during the step) + float32 gradient 4 + two AdamW moments 8 = 18. Accumulating the
gradient in bfloat16 would save 2 bytes but round every microbatch's contribution to 8
bits of mantissa; FSDP2 (`MixedPrecisionPolicy(reduce_dtype=float32)`) and Megatron-LM
accumulate in float32 too.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRECISION_NAMES", "PrecisionPolicy", "precision_policy", "DTYPE_BYTES"]

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of one training precision (names of torch dtypes, so no torch import)."""

    name: str
    master: str
    """the dtype the parameters (and the optimizer) keep"""
    compute: str
    """the dtype forward and backward compute in (weights cast to it, activations in it)"""
    reduce: str
    """the dtype gradients accumulate and are reduced in"""

    @property
    def mixed(self) -> bool:
        """Whether the compute dtype differs from the master dtype (a cast copy of the weights)."""
        return self.compute != self.master

    @property
    def master_bytes(self) -> int:
        return DTYPE_BYTES[self.master]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations and of the weights' compute copy."""
        return DTYPE_BYTES[self.compute]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.reduce]

    @property
    def optimizer_bytes(self) -> int:
        """AdamW's two moments per parameter, in the master dtype."""
        return 2 * DTYPE_BYTES[self.master]


_POLICIES = {
    "fp32": PrecisionPolicy("fp32", "float32", "float32", "float32"),
    "fp64": PrecisionPolicy("fp64", "float64", "float64", "float64"),
    "bf16-mixed": PrecisionPolicy("bf16-mixed", "float32", "bfloat16", "float32"),
}
PRECISION_NAMES = tuple(_POLICIES)
# the dtype names --dtype took before --precision
_ALIASES = {"float32": "fp32", "float64": "fp64", "bf16": "bf16-mixed"}


def precision_policy(name: str) -> PrecisionPolicy:
    """The policy called `name` (also "float32", "float64", the old --dtype names)."""
    policy = _POLICIES.get(_ALIASES.get(name, name))
    if policy is None:
        raise ValueError(f"precision {name!r}: choose one of {', '.join(PRECISION_NAMES)}")
    return policy
