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
during the call), keeps the requested parts, moves them to `device` as uninitialised memory
and fills every parameter either from `init(name, tensor)`, a function of the full-model
name alone (so a stage gets the same weights whichever stages are built beside it), or
from `state_dict` (the full model's names; only this stage's keys are read). Buffers are
created for real by the model's constructor (rotary tables, masks: computed and small)
and keep their values; a shared module is copied into each stage.

What is refused, one line each: a path that does not exist (with the children found
where it failed), a blocks path that is not an `nn.ModuleList`, fewer blocks than stages,
explicit counts that do not fit, parameters outside every part of the layout, a shared
module with parameters, and a parameter tied across parts (untie it: one stage cannot
hold another's weight).
"""
from __future__ import annotations

import contextlib
import copy
import numbers
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from .adapter import BlockAdapter
from .layout import Layout, block_ranges
from .stage import Stage

__all__ = ["split_model", "allocate_stages", "resolve", "ParamInit"]

ParamInit = Callable[[str, Tensor], None]
"""init(name, tensor): fill `tensor` in place from the full-model parameter `name` alone."""


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
    blocks, parts = _parts(model, layout)
    ranges = block_ranges(len(blocks), num_stages, counts, blocks=layout.blocks)
    return [_stage(s, num_stages, ranges, layout, parts, blocks, adapter, shared=lambda m: m)
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
    adapter: BlockAdapter | None = None,
    counts: Sequence[int] | None = None,
) -> list[Stage]:
    """Build only `stages` of the model `make_model()` builds, on `device`; nothing else is allocated.

    Give exactly one of `init` (per-parameter-name initializer) or `state_dict`.
    """
    if (init is None) == (state_dict is None):
        raise ValueError("allocate_stages needs exactly one of init= (fill each parameter from its name) or "
                         "state_dict= (the full model's weights)")
    wanted = _wanted(stages, num_stages)
    device = torch.device(device) if device is not None else torch.get_default_device()
    with _parameters_on_meta():
        skeleton = make_model()
    blocks, parts = _parts(skeleton, layout)
    ranges = block_ranges(len(blocks), num_stages, counts, blocks=layout.blocks)
    built = []
    for s in wanted:
        stage = _stage(s, num_stages, ranges, layout, parts, blocks, adapter, shared=copy.deepcopy)
        _materialize(stage, device)
        if init is not None:
            with torch.no_grad():
                for name, param in stage.named_parameters():
                    init(name, param)
        else:
            _load(stage, state_dict)
        built.append(stage)
    return built


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


def _parts(model: nn.Module, layout: Layout) -> tuple[nn.ModuleList, dict[str, nn.Module]]:
    """The block list and the other parts by path, checked against the model."""
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
    _check_untied(blocks, parts, layout)
    return blocks, parts


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


def _check_untied(blocks: nn.ModuleList, parts: Mapping[str, nn.Module], layout: Layout) -> None:
    seen: dict[int, str] = {}
    named = [(f"{layout.blocks}.{i}", b) for i, b in enumerate(blocks)] + list(parts.items())
    for path, module in named:
        for name, param in module.named_parameters(remove_duplicate=False):
            full = f"{path}.{name}"
            if id(param) in seen:
                raise ValueError(
                    f"{full} and {seen[id(param)]} are one parameter (tied weights); stages are built with a weight "
                    "each: untie them (for Hugging Face models, tie_word_embeddings=False)"
                )
            seen[id(param)] = full


def _stage(s: int, num_stages: int, ranges: tuple[range, ...], layout: Layout, parts: Mapping[str, nn.Module],
           blocks: nn.ModuleList, adapter: BlockAdapter | None, *, shared: Callable[[nn.Module], nn.Module]) -> Stage:
    mine: dict[str, nn.Module] = {}
    if s == 0:
        mine.update((p, parts[p]) for p in layout.before)
    if s == num_stages - 1:
        mine.update((p, parts[p]) for p in layout.after)
    mine.update((p, shared(parts[p])) for p in layout.shared)
    return Stage(index=s, num_stages=num_stages, layers=ranges[s], layout=layout, parts=mine,
                 blocks={i: blocks[i] for i in ranges[s]}, adapter=adapter)


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


def _materialize(stage: Stage, device: torch.device) -> None:
    """Parameters to uninitialised memory on `device` (to be filled); buffers keep their values."""
    buffers = {name: b for name, b in stage.named_buffers()}
    stage.to_empty(device=device)
    with torch.no_grad():
        for name, b in stage.named_buffers():
            source = buffers[name]
            if source.is_meta:
                raise ValueError(f"buffer {name} was built on the meta device, so it has no value to keep: "
                                 "create buffers on a real device in the model's constructor")
            b.copy_(source)


def _load(stage: Stage, state_dict: Mapping[str, Tensor]) -> None:
    wanted = list(stage.state_dict().keys())
    missing = [k for k in wanted if k not in state_dict]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ValueError(
            f"stage {stage.index}: the state dict has no {', '.join(missing[:3])}{more}; give the full model's "
            "state dict, with the names model.state_dict() uses"
        )
    stage.load_state_dict({k: state_dict[k] for k in wanted}, strict=True)
