"""Cut any model whose repeated blocks sit in one `nn.ModuleList` into pipeline stages.

    >>> layout = Layout(blocks="layers", before=("embed",), after=("norm", "head"))
    >>> stages = split_model(model, layout, 4)          # all 4 stages, sharing model's parameters
    >>> mine = allocate_stages(lambda: MyModel(cfg), layout, num_stages=4, stages=(0, 3),
    ...                        device="cuda", init=my_init)     # one V rank of p=2: only its stages

Stage s holds the s-th contiguous slice of blocks (`layout.block_ranges`), stage 0 also the
before-modules and the last stage the after-modules. The placement (loop, V) only decides
which rank asks for which stages, so both functions take `stages=` (global indices).

`split_model` wraps the model's own modules: one process that runs every stage (the
profiler, the one-process reference) sees the model's parameters and gradients.

`allocate_stages` builds only the requested stages. It calls `make_model()` with every
parameter created on the meta device (a global parameter-registration hook, held only
during the call), keeps the requested parts, lets `prepare(stage)` change them while they
are still on the meta device (tensor parallelism: `tp_plan.parallelize_stage`
makes each parameter a DTensor of this rank's shard), moves them to `device` (in `dtype`,
when given) as uninitialised memory and fills every parameter from exactly one source:

    init(name, tensor)   a function of the full-model name alone (so a stage gets the same
                         weights whichever stages are built beside it)
    state_dict           the full model's names; only this stage's keys are read
    weights              a `WeightSource` (`read(name, region)`: safetensors files, read
                         lazily, only the tensors, or with tensor parallelism only the
                         slices, this rank holds)

A parameter that `prepare` made a DTensor is filled with its local region only. Buffers
are created for real by the model's constructor (rotary tables, masks: computed and small)
and keep their values; a shared module is copied into each stage.

Tied input and output embeddings (a head that shares the embedding's weight, as
`tie_word_embeddings` models do) are the one tie allowed: a parameter of a before-module
that is also a parameter of an after-module. The stages record it (`Stage.tied`); the
first and last stages built apart each get a copy, filled from the embedding's name, and
the runtime keeps the two equal by summing their gradients (`runtime.tied`).

What is refused, one line each: a path that does not exist (with the children found
where it failed), a blocks path that is not an `nn.ModuleList`, fewer blocks than stages,
explicit counts that do not fit, parameters outside every part of the layout, a shared
module with parameters, and any other parameter shared by two parts (a block's weight
used elsewhere: one stage cannot hold another's weight).
"""
from __future__ import annotations

import contextlib
import copy
import numbers
from typing import Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from .adapter import BlockAdapter
from .layout import Layout, block_ranges
from .stage import Stage, TiedPair

__all__ = [
    "split_model", "allocate_stages", "default_dtype", "resolve", "ParamInit", "WeightSource", "skeleton_stage",
    "tied_pairs",
]

ParamInit = Callable[[str, Tensor], None]
"""init(name, tensor): fill `tensor` in place from the full-model parameter `name` alone."""


class WeightSource(Protocol):
    """Where pretrained weights come from, one tensor (or one region of it) at a time."""

    def read(self, name: str, shape: tuple[int, ...], region: tuple[slice, ...] | None = None) -> Tensor:
        """The tensor `name` (expected to have `shape`; a mismatch is a ValueError naming both),
        or only its `region`, as a CPU tensor in the dtype it is stored in."""
        ...


def split_model(
    model: nn.Module,
    layout: Layout,
    num_stages: int,
    *,
    adapter: BlockAdapter | None = None,
    counts: Sequence[int] | None = None,
    stages: Iterable[int] | None = None,
) -> list[Stage]:
    """Stages of `model` that share its modules (a gradient on a stage is on the model).

    stages: the global stage indices wanted (default all, in order).
    """
    blocks, parts, tied = _parts(model, layout)
    ranges = block_ranges(len(blocks), num_stages, counts, blocks=layout.blocks)
    return [_stage(s, num_stages, ranges, layout, parts, blocks, adapter, tied, shared=lambda m: m)
            for s in _wanted(stages, num_stages)]


def allocate_stages(
    make_model: Callable[[], nn.Module],
    layout: Layout,
    *,
    num_stages: int,
    stages: Iterable[int],
    device: torch.device | str | None = None,
    init: ParamInit | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
    weights: WeightSource | None = None,
    adapter: BlockAdapter | None = None,
    counts: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    prepare: Callable[[Stage], object] | None = None,
) -> list[Stage]:
    """Build only `stages` of the model `make_model()` builds, on `device`; nothing else is allocated.

    Give exactly one of `init` (per-parameter-name initializer), `state_dict` or `weights`.
    dtype: the parameters' (and floating buffers') dtype, when it differs from the model's.
    prepare: called on each stage while its parameters are on the meta device.
    """
    if sum(x is not None for x in (init, state_dict, weights)) != 1:
        raise ValueError("allocate_stages needs exactly one of init= (fill each parameter from its name), "
                         "state_dict= (the full model's weights) or weights= (a WeightSource, e.g. safetensors)")
    wanted = _wanted(stages, num_stages)
    device = torch.device(device) if device is not None else torch.get_default_device()
    with _parameters_on_meta(), default_dtype(dtype):
        skeleton = make_model()
    blocks, parts, tied = _parts(skeleton, layout)
    ranges = block_ranges(len(blocks), num_stages, counts, blocks=layout.blocks)
    built = []
    for s in wanted:
        stage = _stage(s, num_stages, ranges, layout, parts, blocks, adapter, tied, shared=copy.deepcopy)
        if prepare is not None:
            prepare(stage)
        _materialize(stage, device, dtype)
        if init is not None:
            _fill(stage, lambda name, like: _initialised(init, name, like))
        elif weights is not None:
            _fill(stage, lambda name, like, region=None: weights.read(name, tuple(like.shape), region),
                  regions=True)
        else:
            _load(stage, state_dict)
        built.append(stage)
    return built


def skeleton_stage(spec, num_stages: int, stage: int) -> Stage:
    """Stage `stage` of a `ModelSpec`'s model with its parameters on the meta device (shapes and
    names only; nothing is allocated)."""
    with _parameters_on_meta():
        skeleton = spec.build()
    blocks, parts, tied = _parts(skeleton, spec.layout)
    ranges = block_ranges(len(blocks), num_stages, None, blocks=spec.layout.blocks)
    return _stage(stage, num_stages, ranges, spec.layout, parts, blocks, spec.adapter, tied, shared=copy.deepcopy)


def tied_pairs(model: nn.Module, layout: Layout) -> tuple[TiedPair, ...]:
    """The embedding/head ties of `model` under `layout` (empty when its head is its own)."""
    return _parts(model, layout)[2]


def resolve(model: nn.Module, path: str) -> nn.Module:
    """The submodule at dotted `path`; a missing one is a ValueError naming the children there."""
    module, walked = model, []
    for atom in path.split("."):
        children = dict(module.named_children())
        if atom not in children:
            top = ", ".join(n for n, _ in model.named_children()) or "none"
            where = f"; {'.'.join(walked)!r} has {', '.join(children) or 'no children'}" if walked else ""
            raise ValueError(
                f"module path {path!r} does not exist in {type(model).__name__}: no {atom!r} at "
                f"{'.'.join(walked) or 'the top level'}{where}; the model's top-level children are: {top}"
            )
        module, walked = children[atom], [*walked, atom]
    return module


def _wanted(stages: Iterable[int] | None, num_stages: int) -> list[int]:
    if num_stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got num_stages={num_stages}")
    wanted = list(range(num_stages)) if stages is None else list(stages)
    for s in wanted:
        if not isinstance(s, numbers.Integral) or not 0 <= s < num_stages:
            raise ValueError(f"stage {s!r} is out of range: the pipeline has stages 0..{num_stages - 1}")
    wanted = [int(s) for s in wanted]
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"stages {wanted} name a stage twice: give each global stage index once")
    return wanted


def _parts(model: nn.Module, layout: Layout) -> tuple[nn.ModuleList, dict[str, nn.Module], tuple[TiedPair, ...]]:
    """The block list, the other parts by path and the embedding/head ties, checked against the model."""
    blocks = resolve(model, layout.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(
            f"blocks path {layout.blocks!r} is a {type(blocks).__name__}, not an nn.ModuleList: name the "
            f"ModuleList that holds the repeated blocks"
        )
    parts = {path: resolve(model, path) for path in (*layout.before, *layout.after, *layout.shared)}
    for path in layout.shared:
        held = [n for n, _ in parts[path].named_parameters()]
        if held:
            raise ValueError(f"shared module {path!r} holds parameters ({', '.join(held[:3])}): every stage holds a "
                             "shared module, so it must be parameter-free; list it in before= or after= instead")
    _check_covered(model, layout)
    return blocks, parts, _ties(blocks, parts, layout)


def _check_covered(model: nn.Module, layout: Layout) -> None:
    """Every parameter and persistent buffer lies in some part: the stages add up to the model."""
    roots = tuple(p + "." for p in layout.paths())
    outside = [k for k in model.state_dict(keep_vars=True) if not k.startswith(roots)]
    if outside:
        more = f" and {len(outside) - 3} more" if len(outside) > 3 else ""
        raise ValueError(
            f"{', '.join(outside[:3])}{more} lie outside the layout, so no stage would hold them: add their "
            "modules to before= (run before the blocks) or after= (run after them)"
        )


def _ties(blocks: nn.ModuleList, parts: Mapping[str, nn.Module], layout: Layout) -> tuple[TiedPair, ...]:
    """The parameters an after-module shares with a before-module (tied embeddings); any other
    parameter seen twice is refused."""
    seen: dict[int, str] = {}
    before = {f"{p}." for p in layout.before}
    after = {f"{p}." for p in layout.after}
    pairs = []
    named = [(f"{layout.blocks}.{i}", b) for i, b in enumerate(blocks)] + list(parts.items())
    for path, module in named:
        for name, param in module.named_parameters(remove_duplicate=False):
            full = f"{path}.{name}"
            first = seen.get(id(param))
            if first is None:
                seen[id(param)] = full
            elif first.startswith(tuple(before)) and full.startswith(tuple(after)):
                pairs.append(TiedPair(first=first, last=full))
            else:
                raise ValueError(
                    f"{full} and {first} are one parameter (tied weights); stages are built with a weight each, and "
                    "the one tie they keep equal is a head that shares the embedding's weight (a module of before= "
                    "and one of after=): untie the others"
                )
    return tuple(pairs)


def _stage(s: int, num_stages: int, ranges: tuple[range, ...], layout: Layout, parts: Mapping[str, nn.Module],
           blocks: nn.ModuleList, adapter: BlockAdapter | None, tied: tuple[TiedPair, ...], *,
           shared: Callable[[nn.Module], nn.Module]) -> Stage:
    mine: dict[str, nn.Module] = {}
    if s == 0:
        mine.update((p, parts[p]) for p in layout.before)
    if s == num_stages - 1:
        mine.update((p, parts[p]) for p in layout.after)
    mine.update((p, shared(parts[p])) for p in layout.shared)
    return Stage(index=s, num_stages=num_stages, layers=ranges[s], layout=layout, parts=mine,
                 blocks={i: blocks[i] for i in ranges[s]}, adapter=adapter, tied=tied)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """While held, tensors created without a dtype are `dtype` (None: unchanged): a model built
    in the run's precision makes its float buffers (a Gemma's embedding scale) in it too, as
    transformers' `from_pretrained(dtype=...)` does."""
    if dtype is None or not dtype.is_floating_point:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While held, every parameter a module registers is replaced by a meta tensor of its shape."""

    def to_meta(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
        if param.is_meta:
            return None
        return nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    handle = register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def _materialize(stage: Stage, device: torch.device, dtype: torch.dtype | None) -> None:
    """Parameters to uninitialised memory on `device`, in `dtype` if given (to be filled);
    buffers keep their values."""
    buffers = {name: b for name, b in stage.named_buffers()}
    stage.to_empty(device=device)
    if dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in stage.parameters()):
        stage.to(dtype)  # floating buffers follow, as the whole model's `.to(dtype)` converts them
    with torch.no_grad():
        for name, b in stage.named_buffers():
            source = buffers[name]
            if source.is_meta:
                raise ValueError(f"buffer {name} was built on the meta device, so it has no value to keep: "
                                 "create buffers on a real device in the model's constructor")
            b.copy_(source)


def _initialised(init: ParamInit, name: str, like: Tensor) -> Tensor:
    """A whole tensor shaped and typed like `like`, filled by `init` (for a parameter held as a shard)."""
    full = torch.empty(tuple(like.shape), dtype=like.dtype)
    with torch.no_grad():
        init(name, full)
    return full


def _fill(stage: Stage, source: Callable[..., Tensor], *, regions: bool = False) -> None:
    """Fill every parameter from `source(name, param[, region])`, by the name its values have in
    the full model (a tied copy: the embedding's). A DTensor parameter (a tensor-parallel
    shard) takes only its local region, read as such when the source reads regions."""
    from torch.distributed.tensor import DTensor  # DTensor takes 0.4 s to import: loaded only for a tensor-parallel run

    canonical = {pair.last: pair.first for pair in stage.tied}
    with torch.no_grad():
        for name, param in stage.named_parameters():
            origin = canonical.get(name, name)
            if not isinstance(param, DTensor):
                param.copy_(source(origin, param))
                continue
            region = _local_region(param)
            values = source(origin, param, region) if regions else source(origin, param)[region]
            param.to_local().copy_(values)


def _local_region(param) -> tuple[slice, ...]:
    """The slices of the full tensor that this rank's shard of the DTensor `param` holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # DTensor: see above

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _load(stage: Stage, state_dict: Mapping[str, Tensor]) -> None:
    canonical = {pair.last: pair.first for pair in stage.tied}
    state_dict = {**{copy: state_dict[first] for copy, first in canonical.items()
                     if copy not in state_dict and first in state_dict}, **state_dict}
    wanted = list(stage.state_dict().keys())
    missing = [k for k in wanted if k not in state_dict]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(
            f"stage {stage.index}: the state dict has no {', '.join(missing[:3])}{more}; give the full model's "
            "state dict, with the names model.state_dict() uses"
        )
    stage.load_state_dict({k: state_dict[k] for k in wanted}, strict=True)
