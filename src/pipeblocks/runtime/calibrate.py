"""Measuring the device: pass times, FLOPs, saved bytes, peak and links (the torch side of
`pipeblocks calibrate`; the fit and the profile file are `pipeblocks.sim.hardware_profile`'s).

    >>> shape = Shape(hidden=128, seq=64, microbatch=2, heads=4)
    >>> point = measure_shape("gpt", shape, precision="fp32", device="cpu")
    >>> point.parts["block"]["F"].seconds, point.parts["block"]["F"].flops
    >>> peak_flops("fp32", "cpu")                     # a large matmul's FLOP/s: the peak on a CPU
    >>> counts = count_stage_passes(stages, tokens, loss_fn, targets)   # FLOPs per stage and pass

One shape is timed on a three-stage split of a three-block model of the family (stage 0:
the embedding and a block; stage 1: a block; stage 2: a block and the head with the loss),
with the runtime's own forward and split backward (`profile.profile_stage_times`): the
middle stage is one block; the embedding and the head are the end stages less a block.
Stage 0 has no input gradient, so its B does nothing and its W runs the whole backward, as
in the runtime.

FLOPs are counted, not assumed: a dispatch mode sees every matrix product the passes run
(mm, addmm, bmm, baddbmm: 2*M*K*N) and every fused attention (scaled dot-product
attention: 4*b*a*s_q*s_k*d forward, twice that backward, the Zero Bubble paper's count,
causal or not). The products' arithmetic intensity is their FLOPs over the bytes of their
operands and result (the planner's roofline form, `plan.intensity`). Element-wise work
(norms, activations, the softmax of the loss) has no FLOPs here: its time is part of what
the fitted fraction of the peak absorbs.

On a GPU the clock synchronizes the device before it reads the time (`device_clock`), so a
pass's time is the device's. `--device cuda` without CUDA is one ValueError.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .. import schedules
from ..models.build import build_model, split_stages
from ..models.family import get_family
from ..models.toy import ToyConfig, cross_entropy, toy_batch, toy_stages
from ..sim.overhead import local_gaps
from .launch import choose_device, default_device, spawn
from .profile import grads_kept, measure_passes, profile_stage_memory, profile_stage_times
from .runner import PipelineRunner

__all__ = [
    "Shape", "PassMeasure", "ShapePoint", "PassCount", "GemmCounter", "count_stage_passes", "measure_shape",
    "peak_flops", "memory_bandwidth", "device_clock", "resolve_device", "available_memory", "shape_bytes",
    "measure_links", "COMPUTE_DTYPES",
]

# the dtype the passes compute in, per precision (bf16-mixed computes in bfloat16)
COMPUTE_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16-mixed": torch.bfloat16}

_GEMMS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}
_ATTENTION_FORWARD = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default", "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
}
_ATTENTION_BACKWARD = {name.replace(".default", "_backward.default") for name in _ATTENTION_FORWARD}


@dataclass(frozen=True)
class Shape:
    """One point of the grid: model width, tokens per sequence, sequences per microbatch, heads."""

    hidden: int
    seq: int
    microbatch: int
    heads: int = 4

    def __post_init__(self) -> None:
        for name in ("hidden", "seq", "microbatch", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"shape {name} must be an integer >= 1, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"shape {self.text}: hidden {self.hidden} is not a multiple of heads {self.heads}: "
                             f"give HIDDENxSEQxMICROBATCHxHEADS with heads dividing hidden")

    @property
    def text(self) -> str:
        return f"{self.hidden}x{self.seq}x{self.microbatch}x{self.heads}"


@dataclass
class PassCount:
    """FLOPs one pass runs; `gemm_flops` and `gemm_bytes` are its matrix products' alone."""

    flops: float = 0.0
    gemm_flops: float = 0.0
    gemm_bytes: float = 0.0

    @property
    def intensity(self) -> float:
        """FLOPs per byte of the pass's matrix products (0 without any)."""
        return self.gemm_flops / self.gemm_bytes if self.gemm_bytes else 0.0

    def minus(self, other: PassCount) -> PassCount:
        return PassCount(max(0.0, self.flops - other.flops), max(0.0, self.gemm_flops - other.gemm_flops),
                         max(0.0, self.gemm_bytes - other.gemm_bytes))

    def plus(self, other: PassCount) -> PassCount:
        return PassCount(self.flops + other.flops, self.gemm_flops + other.gemm_flops,
                         self.gemm_bytes + other.gemm_bytes)


class GemmCounter(TorchDispatchMode):
    """Counts the FLOPs of matrix products and fused attention while active (see the module
    docstring); `count` is the running total."""

    def __init__(self) -> None:
        super().__init__()
        self.count = PassCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name in _GEMMS:
            a, b = (args[1], args[2]) if name in ("aten.addmm.default", "aten.baddbmm.default") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            flops = 2.0 * batch * m * k * n
            self.count.flops += flops
            self.count.gemm_flops += flops
            self.count.gemm_bytes += a.element_size() * batch * (m * k + k * n + m * n)
        elif name in _ATTENTION_FORWARD or name in _ATTENTION_BACKWARD:
            # q, k: [b, heads, tokens, head_dim] (the backward takes the output gradient first)
            q, k = (args[1], args[2]) if name in _ATTENTION_BACKWARD else (args[0], args[1])
            b, a, sq, d = q.shape
            self.count.flops += (8.0 if name in _ATTENTION_BACKWARD else 4.0) * b * a * sq * k.shape[-2] * d
        return out


def count_stage_passes(
    stages: Sequence[torch.nn.Module], inputs: torch.Tensor, loss_fn: Callable, target: torch.Tensor,
) -> tuple[tuple[PassCount, PassCount, PassCount], ...]:
    """Per stage, the FLOPs of (F, B, W) of one microbatch through all stages in this process
    (`profile.measure_passes`). Parameter `.grad` is left as it was."""
    with grads_kept(stages):
        meters = measure_passes(stages, inputs, loss_fn, target, GemmCounter)
    return tuple(tuple(counter.count for counter in passes) for passes in meters)


@dataclass(frozen=True)
class PassMeasure:
    """One pass of one part at one shape: seconds (the fastest run), counted FLOPs and their intensity."""

    seconds: float
    flops: float
    intensity: float


@dataclass(frozen=True)
class ShapePoint:
    """What one shape measured: per part ("embedding", "block", "head") and pass ("F", "B",
    "W"), a PassMeasure; the block's saved bytes (M_B) and what it keeps from B to W (M_W)."""

    shape: Shape
    parts: dict[str, dict[str, PassMeasure]]
    saved_bytes: int
    kept_for_w_bytes: int
    notes: tuple[str, ...] = field(default=())


def resolve_device(requested: str) -> torch.device:
    """cpu, cuda or auto (CUDA when there is one), as `launch.choose_device` picks it for one
    rank; cuda without CUDA is one ValueError."""
    return default_device(0, choose_device(requested, 1))


def device_clock(device: torch.device) -> Callable[[], float]:
    """perf_counter, after the device's queued work is done on a GPU."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def available_memory(device: torch.device) -> int:
    """Bytes free on the device: the GPU's free memory, or the machine's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def shape_bytes(shape: Shape, vocab: int, element_bytes: int) -> int:
    """A generous estimate of what timing `shape` holds at once: the three-block model's
    parameters, gradients and a copy, three blocks' activations (about 34*h elements per
    token each) and the logits with their log-probabilities and gradient (fp32)."""
    h, tokens = shape.hidden, shape.seq * shape.microbatch
    params = 3 * (12 * h * h + 13 * h) + (vocab + shape.seq) * h + h * vocab + 2 * h
    return int(3 * params * element_bytes + 3 * tokens * 34 * h * element_bytes + 3 * tokens * vocab * 4)


def measure_shape(
    family: str, shape: Shape, *, precision: str, device: torch.device | str = "cpu", vocab: int = 256,
    repeats: int = 5, seed: int = 0,
) -> ShapePoint:
    """Time and count one shape (see the module docstring); the weights of `seed`."""
    device = torch.device(device)
    fam = get_family(family)
    dtype = COMPUTE_DTYPES[precision]
    config = fam.config(layers=3, hidden=shape.hidden, heads=shape.heads, seq=shape.seq, vocab=vocab,
                        dtype="float64" if precision == "fp64" else "float32")
    spec = fam.spec(config)
    stages = split_stages(spec, build_model(spec, seed=seed).to(device=device, dtype=dtype), 3)
    loss_fn = spec.loss
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (shape.microbatch, shape.seq + 1), generator=gen).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    # the fastest run: on a shared machine other work only ever slows a pass down
    times = profile_stage_times(stages, x, loss_fn, y, repeats=repeats, clock=device_clock(device), reduce=min)
    counts = count_stage_passes(stages, x, loss_fn, y)
    memory = profile_stage_memory(stages, x, loss_fn, y)
    kinds = ("F", "B", "W")
    block = {k: PassMeasure(times[1][i], counts[1][i].flops, counts[1][i].intensity) for i, k in enumerate(kinds)}
    notes = []

    def less_block(stage: int, name: str) -> dict[str, PassMeasure]:
        out = {}
        for i, k in enumerate(kinds):
            own = counts[stage][i]
            # stage 0 runs the block's B and W inside its W (no input gradient)
            block_time = times[1][0] if k == "F" else (times[1][1] + times[1][2] if stage == 0 and k == "W" else
                                                       0.0 if stage == 0 else times[1][i])
            block_count = counts[1][0] if k == "F" else (
                counts[1][1].plus(counts[1][2]) if stage == 0 and k == "W" else PassCount() if stage == 0
                else counts[1][i])
            seconds = times[stage][i] - block_time
            if seconds < 0:
                notes.append(f"{name} {k}: the stage took {times[stage][i]:.3g} s, less than the block's "
                             f"{block_time:.3g} s (timing noise); counted as 0")
            rest = own.minus(block_count)
            out[k] = PassMeasure(max(0.0, seconds), rest.flops, rest.intensity)
        return out

    return ShapePoint(shape, {"embedding": less_block(0, "embedding"), "block": block, "head": less_block(2, "head")},
                      int(memory[1].m_b), int(memory[1].m_w), tuple(notes))


def peak_flops(precision: str, device: torch.device | str = "cpu", *, size: int | None = None,
               repeats: int = 20) -> tuple[float, str]:
    """(FLOP/s, how it was measured): the best of `repeats` products of two size x size
    matrices in the precision's compute dtype, the most of the peak a program reaches on
    this device (on a CPU, with torch's current threads)."""
    device = torch.device(device)
    dtype = COMPUTE_DTYPES[precision]
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    clock = device_clock(device)
    torch.mm(a, b)  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = clock()
        torch.mm(a, b)
        best = min(best, clock() - start)
    threads = "" if device.type == "cuda" else f", {torch.get_num_threads()} thread(s)"
    how = (f"measured: the best of {repeats} products of two {size} x {size} {str(dtype).removeprefix('torch.')} "
           f"matrices on {device.type}{threads}")
    return 2.0 * size ** 3 / best, how


def memory_bandwidth(device: torch.device | str = "cpu", *, megabytes: int = 64, repeats: int = 5) -> tuple[float, str]:
    """(bytes/s, how): the best of `repeats` copies of a `megabytes` tensor (read + write)."""
    device = torch.device(device)
    n = megabytes * (1 << 20) // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    clock = device_clock(device)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        start = clock()
        dst.copy_(src)
        best = min(best, clock() - start)
    return 2 * n * 4 / best, f"measured: the best of {repeats} copies of {megabytes} MiB (read and write)"


# ---- links between two local processes ----------------------------------------------------

LINK_SIZES = (4, 4096, 65536, 1 << 20, 4 << 20)
"""Message bytes timed for point-to-point and all-reduce."""


def _link_worker(ctx, sizes: Sequence[int], rounds: int) -> dict:
    device = ctx.device
    p2p, reduce = [], []
    for size in sizes:
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=device)
        samples = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            if ctx.rank == 0:
                dist.send(buffer, 1)
                dist.recv(buffer, 1)
            elif ctx.rank == 1:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append((time.perf_counter() - start) / 2)  # one way
        p2p.append((buffer.numel() * 4, statistics.median(samples)))
        samples = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buffer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - start)
        reduce.append((buffer.numel() * 4, statistics.median(samples)))
    return {"p2p": p2p, "all_reduce": reduce, "between_passes": _between_passes(ctx)}


def _between_passes(ctx, steps: int = 6, warmup: int = 2) -> float | None:
    """The runtime's own time between two passes of a rank (`sim.overhead.local_gaps`, as the
    train report measures it), on a tiny model over the first two ranks with 1F1B: what a
    run adds to every pass beyond its compute. None on the other ranks."""
    if ctx.world_size != 2:
        return None
    schedule = schedules.get("1f1b")(p=2, m=8)
    config = ToyConfig(vocab=16, hidden=16, seq=8)
    stages = toy_stages(2, config, dtype=torch.float32)
    mine = {ctx.rank: stages[ctx.rank].to(ctx.device)}
    runner = PipelineRunner(schedule, mine, cross_entropy, rank=ctx.rank, device=ctx.device, record_timeline=True,
                            measure_memory=False, timeout_s=60.0)
    gaps = []
    for step in range(steps):
        x, y = toy_batch(8 * 2, config, seed=step)
        dist.barrier()
        result = runner.step(x.to(ctx.device), y.to(ctx.device))
        if result.timeline is not None and step >= warmup:
            gaps.extend(local_gaps(result.timeline))
    return statistics.fmean(gaps) if gaps else None


def measure_links(device: torch.device | str = "cpu", *, ranks: int = 2, sizes: Sequence[int] = LINK_SIZES,
                  rounds: int = 20, timeout_s: float = 300.0) -> dict:
    """Median one-way point-to-point time (ranks 0 and 1, ping-pong / 2) and all-reduce time
    over `ranks` local processes, per message size in bytes: {"p2p": [(bytes, s)],
    "all_reduce": [(bytes, s)], "ranks", "backend"} (gloo on CPU, NCCL on GPUs)."""
    kind = torch.device(device).type
    results = spawn(_link_worker, ranks, args=(tuple(sizes), rounds), timeout_s=timeout_s, threads_per_rank=1,
                    device=kind)
    out = dict(results[0])
    out.update(ranks=ranks, backend="nccl" if kind == "cuda" else "gloo")
    return out
