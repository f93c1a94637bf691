"""Kernel efficiency from arithmetic intensity: a small GEMM reaches less of the peak.

A matrix product of an M x K by a K x N operand does 2*M*K*N FLOPs and, at best, moves its
three operands through device memory once, e*(M*K + K*N + M*N) bytes in a dtype of e
bytes. Its arithmetic intensity I (FLOPs per byte) against the device's ridge point
R = peak FLOP/s / memory bytes/s says how much of the time the memory traffic takes. The
planner charges the two as if they did not overlap (a smooth roofline, Williams et al.
2009, "Roofline: an insightful visual performance model")::

    time = FLOPs / peak + bytes / memory bandwidth,   so   efficiency(I) = 1 / (1 + R / I)

of the profile's achievable fraction, which is then the ceiling that a very large GEMM
approaches. The only constants are the data sheet's: on an A100 SXM 80GB, 312 TFLOP/s
dense bf16 and 2039 GB/s of HBM, R = 153 FLOP/byte. Nothing is fitted to a benchmark.

In a transformer layer every GEMM has M = s*b rows (the tokens of a microbatch), and
under Megatron tensor parallelism its other two sides are the hidden size h and the
per-rank width (`sim.analytic.layer_gemms`): for the GPT QKV h x 3h/t, the attention
projection h/t x h, the MLP h x 4h/t and 4h/t x h; for other shapes q h x a*d/t, k and v
h x k*d/t each (grouped-query attention makes them narrow), the out projection a*d/t x h,
the MLP's gate and up h x f/t each (SwiGLU) and down f/t x h. The forward, the input
gradient and the weight gradient multiply the same three sides in a different order, so
one intensity serves all three passes. The layer's efficiency is the FLOP-weighted
harmonic mean of its GEMMs'; attention's s x s products (4s/(24h) of a GPT layer's FLOPs:
2% at s = 1024 on a 10240-wide model) are charged at the same rate, and element-wise
kernels stay inside the profile's fraction. The LM head is an s*b x h by h x V/t product. So larger microbatches (more rows) and lower tensor
parallelism (wider GEMMs) run closer to the ceiling, as the Controllable Memory paper
observes of larger microbatches (Qi et al. 2024, Fig. 8).
"""
from __future__ import annotations

from ..sim.analytic import Hardware, TransformerConfig, layer_gemms

__all__ = ["gemm_efficiency", "layer_efficiency", "head_efficiency"]


def gemm_efficiency(rows: int, inner: int, outer: int, *, ridge: float, dtype_bytes: int) -> float:
    """The fraction 1 / (1 + R / I) of the ceiling that a rows x inner by inner x outer
    product reaches, R the device's FLOP/byte ridge point (see the module docstring)."""
    flops = 2.0 * rows * inner * outer
    moved = dtype_bytes * (rows * inner + inner * outer + rows * outer)
    return 1.0 / (1.0 + ridge * moved / flops)


def _ridge(hardware: Hardware) -> float:
    if hardware.memory_bandwidth is None:
        raise ValueError(
            f"hardware {hardware.name!r} has no memory_bandwidth: the intensity model needs the device memory's "
            "bytes/s; give the profile one or turn the model off (--intensity-model off)"
        )
    return hardware.flops / hardware.memory_bandwidth


def layer_efficiency(config: TransformerConfig, hardware: Hardware, tp: int) -> float:
    """A transformer layer's fraction of the ceiling at tensor-parallel degree `tp`."""
    rows, e = config.seq * config.microbatch_size, config.dtype_bytes
    ridge = _ridge(hardware)
    gemms = layer_gemms(config, tp)
    flops = [inner * outer for inner, outer in gemms]
    time = sum(f / gemm_efficiency(rows, k, n, ridge=ridge, dtype_bytes=e) for f, (k, n) in zip(flops, gemms))
    return sum(flops) / time


def head_efficiency(config: TransformerConfig, hardware: Hardware, tp: int) -> float:
    """The LM head's fraction of the ceiling: an s*b x h by h x V/tp product."""
    rows = config.seq * config.microbatch_size
    return gemm_efficiency(rows, config.hidden, config.vocab / tp, ridge=_ridge(hardware),
                           dtype_bytes=config.dtype_bytes)
