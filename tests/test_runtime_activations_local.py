"""Structured activations in one process: the spec of a tuple or dict and its metadata
stream, how a stage is called, the split backward with several roots and inputs, the
recomputation, the emulated compute, the runner's splitting of inputs and side inputs, and
the executor running a one-rank V schedule (two stages handing over locally) against the
same stages chained by hand."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeblocks import schedules
from pipeblocks.core.lowering.validate import validate
from pipeblocks.runtime.backward import fused_backward, input_backward
from pipeblocks.runtime.compute import ModuleCompute
from pipeblocks.runtime.emulate import EmulatedCompute, EmulatedCosts
from pipeblocks.runtime.executor import RankExecutor
from pipeblocks.runtime.memory import SavedTensorTracker
from pipeblocks.runtime.shapes import (
    ActivationSpec, SpecMismatchError, TensorSpec, call_stage, decode_specs, encode_specs, flatten,
    infer_output_spec, zero_gradient,
)
from pipeblocks.runtime.step_inputs import microbatches, side_microbatches

from test_runtime_activations import (
    HIDDEN, MICROBATCH, SEQ, DictFirst, DictMiddle, TupleFirst, loss_fn, reference, toy_data, toy_stages,
)

pytestmark = pytest.mark.torch

CPU = torch.device("cpu")
F64, I64 = torch.float64, torch.int64


def spec(*shape, dtype=F64) -> TensorSpec:
    return TensorSpec(shape, dtype)


# ---- specs and the metadata stream ---------------------------------------------------------------
def test_specs_of_structures_round_trip_through_the_metadata_stream():
    values = [
        torch.zeros(2, 3),
        (torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=I64)),
        {"hidden": torch.zeros(2, 4, 5), "mask": torch.zeros(2, 4, dtype=torch.bool)},
        ({"a": torch.zeros(1), "clé ü": (torch.zeros((), dtype=torch.int32), torch.zeros(3, 0))}, torch.zeros(7)),
    ]
    specs = [ActivationSpec.of(v) for v in values]
    assert decode_specs(encode_specs(specs)) == specs
    assert decode_specs(encode_specs([spec(2, 3)])) == [ActivationSpec.of(torch.zeros(2, 3, dtype=F64))]
    assert str(specs[0]) == "float32[2, 3]"
    assert str(specs[1]) == "(float64[2, 3], int64[2, 3])"
    assert str(specs[2]) == "{'hidden': float32[2, 4, 5], 'mask': bool[2, 4]}"
    assert specs[3].layout.paths() == ["output[0]['a']", "output[0]['clé ü'][0]", "output[0]['clé ü'][1]",
                                       "output[1]"]
    built = specs[2].empty(CPU)
    assert list(built) == ["hidden", "mask"] and built["mask"].dtype == torch.bool


def test_gradients_have_one_tensor_per_floating_leaf():
    one = ActivationSpec.of(torch.zeros(2))
    assert one.gradient() == one
    ids = ActivationSpec.of(torch.zeros(2, dtype=I64)).gradient()
    assert ids.leaves == () and ids.layout.build([]) == ()
    mixed = ActivationSpec.of({"mask": torch.zeros(2, dtype=torch.bool), "h": torch.zeros(3), "g": torch.zeros(4)})
    assert mixed.gradient().leaves == (spec(3, dtype=torch.float32), spec(4, dtype=torch.float32))
    value = {"mask": torch.ones(2, dtype=torch.bool), "h": torch.ones(3)}
    grad = zero_gradient(value)
    assert isinstance(grad, tuple) and len(grad) == 1 and grad[0].shape == (3,)


def test_what_is_not_an_activation_is_refused_with_the_fix():
    with pytest.raises(TypeError, match="return a tuple, not a list"):
        flatten([torch.zeros(1)], "stage 0's output")
    with pytest.raises(TypeError, match=r"stage 0's output\[1\] is int"):
        flatten((torch.zeros(1), 3), "stage 0's output")
    with pytest.raises(TypeError, match="tuple \\(empty\\)"):
        flatten((), "x")
    with pytest.raises(TypeError, match="keys of activations must be str"):
        flatten({1: torch.zeros(1)}, "x")
    expected = ActivationSpec.of((torch.zeros(2, 4), torch.zeros(2, dtype=I64)))
    assert expected.mismatch((torch.zeros(2, 4), torch.zeros(2, dtype=I64))) is None
    assert expected.mismatch((torch.zeros(2, 3), torch.zeros(2, dtype=I64))) == (
        "output[0]", "float32[2, 3]", "float32[2, 4]")
    assert expected.mismatch(torch.zeros(2, 4))[0] == "output"


# ---- calling a stage -----------------------------------------------------------------------------
class Echo(nn.Module):
    def forward(self, *args, **kwargs):
        return args, kwargs


def test_a_tuple_is_positional_a_dict_keywords_and_side_inputs_are_keywords():
    a, b, mask = torch.zeros(1), torch.ones(1), torch.zeros(2)
    assert call_stage(Echo(), a) == ((a,), {})
    args, kwargs = call_stage(Echo(), (a, b), {"mask": mask}, chunk="c")
    assert args == (a, b) and kwargs == {"mask": mask, "chunk": "c"}
    assert call_stage(Echo(), {"h": a}, {"mask": mask}) == ((), {"h": a, "mask": mask})
    with pytest.raises(ValueError, match="key 'mask'.*side input"):
        call_stage(Echo(), {"mask": a}, {"mask": mask})


def test_the_shape_pass_infers_structures_with_side_inputs():
    ids, _, mask = toy_data(1, seed=0)
    out = infer_output_spec(DictFirst(), ActivationSpec.of(ids), CPU, {"mask": mask})
    assert str(out) == (f"{{'hidden': float64[{MICROBATCH}, {SEQ}, {HIDDEN}], 'gate': float64[{MICROBATCH}, {SEQ}, "
                        f"{HIDDEN}], 'keep': bool[{MICROBATCH}, {SEQ}]}}")
    assert infer_output_spec(DictMiddle(), out, CPU, {"mask": mask}) == out
    with pytest.raises(SpecMismatchError, match="cannot take an input of"):
        infer_output_spec(DictFirst(), ActivationSpec.of(ids), CPU)  # no mask given

    class ReturnsList(nn.Module):
        def forward(self, x):
            return [x]

    with pytest.raises(TypeError, match="return a tuple, not a list"):
        infer_output_spec(ReturnsList(), spec(2), CPU)


# ---- the backward with several roots and inputs ----------------------------------------------------
def middle_case(seed: int = 0):
    """A DictMiddle on leaf inputs, its outputs' gradients, and autograd's answer."""
    torch.manual_seed(seed)
    stage = DictMiddle()
    hidden, gate = torch.randn(2, SEQ, HIDDEN, dtype=F64), torch.rand(2, SEQ, HIDDEN, dtype=F64)
    keep, mask = torch.rand(2, SEQ) > 0.4, torch.ones(2, SEQ, dtype=F64)
    grads = [torch.randn(2, SEQ, HIDDEN, dtype=F64) for _ in range(2)]

    def run():
        inputs = [hidden.clone().requires_grad_(True), gate.clone().requires_grad_(True)]
        out = stage(inputs[0], inputs[1], keep, mask=mask)
        return inputs, [out["hidden"], out["gate"]]

    inputs, roots = run()
    torch.autograd.backward(roots, grads)
    want = ([t.grad.clone() for t in inputs], [p.grad.clone() for p in stage.parameters()])
    stage.zero_grad(set_to_none=True)
    return stage, run, grads, want


def test_split_backward_with_several_roots_and_inputs_equals_autograd():
    stage, run, grads, (want_dx, want_dw) = middle_case()
    inputs, roots = run()
    dx, work = input_backward(roots, grads, inputs, list(stage.parameters()))
    assert all(p.grad is None for p in stage.parameters()), "B computes no weight gradient"
    work.run()
    for got, want in zip(dx + [p.grad for p in stage.parameters()], want_dx + want_dw, strict=True):
        assert torch.equal(got, want)
    stage.zero_grad(set_to_none=True)
    inputs, roots = run()
    dx = fused_backward(roots, grads, inputs)
    for got, want in zip(dx + [p.grad for p in stage.parameters()], want_dx + want_dw, strict=True):
        assert torch.equal(got, want)


def test_a_root_that_needs_no_gradient_is_skipped_and_an_unused_input_gets_zeros():
    w = nn.Parameter(torch.ones(3, dtype=F64))
    x, unused = torch.ones(3, dtype=F64, requires_grad=True), torch.ones(2, dtype=F64, requires_grad=True)
    constant = torch.zeros(3, dtype=F64)  # a floating output that depends on nothing
    dx, work = input_backward([x * w, constant], [torch.full((3,), 2.0, dtype=F64)] * 2, [x, unused], [w])
    work.run()
    assert torch.equal(dx[0], torch.full((3,), 2.0, dtype=F64)) and torch.equal(dx[1], torch.zeros(2, dtype=F64))
    assert torch.equal(w.grad, torch.full((3,), 2.0, dtype=F64))
    assert input_backward([constant], [constant], [x], [w])[0] is None  # nothing reaches the input


# ---- recomputation and emulation ----------------------------------------------------------------------
def test_a_recomputed_structured_forward_gives_the_same_gradients_and_counts_its_input():
    ids, _, mask = toy_data(1, seed=3)
    stage0 = TupleFirst()
    x = stage0(ids, mask=mask)
    grads = []
    for keep in (True, False):
        torch.manual_seed(0)
        middle = toy_stages("tuple", 3)[1]
        tracker = SavedTensorTracker()
        compute = ModuleCompute({1: middle}, loss_fn, 2, 1, tracker)
        inp = tuple(t.detach().clone() for t in x)
        out, unit = compute.forward(1, inp, None, keep=keep, side={"mask": mask})
        assert isinstance(out, tuple) and out[1].dtype == I64 and not out[0].requires_grad
        if not keep:
            assert tracker.current == sum(t.untyped_storage().nbytes() for t in inp)  # both leaves held
            compute.recompute(1, unit)
        dx = compute.input_grad(1, unit, (torch.ones_like(out[0]),))
        compute.weight_grad(1, unit)
        assert isinstance(dx, tuple) and len(dx) == 1  # the int64 ids take no gradient
        grads.append([dx[0]] + [p.grad for p in middle.parameters()])
    for got, want in zip(*grads, strict=True):
        assert torch.equal(got, want)


def test_emulated_compute_passes_structures_through():
    ids, _, mask = toy_data(1, seed=0)
    compute = EmulatedCompute(EmulatedCosts(0, 0, 0), {0: DictFirst(), 1: DictMiddle()}, 3)
    out, _ = compute.forward(0, ids, None, side={"mask": mask})
    assert sorted(out) == ["gate", "hidden", "keep"] and out["keep"].dtype == torch.bool
    out2, unit = compute.forward(1, out, None, side={"mask": mask})
    assert ActivationSpec.of(out2) == ActivationSpec.of(out)
    dx = compute.full_backward(1, unit, (torch.zeros(1), torch.zeros(1)))
    assert [t.shape for t in dx] == [out["hidden"].shape, out["gate"].shape]


# ---- the runner's splitting -------------------------------------------------------------------------
def test_inputs_and_side_inputs_split_into_microbatches():
    ids, _, mask = toy_data(2, seed=0)
    parts = microbatches({"ids": ids, "pair": (ids, mask)}, 2, "inputs")
    assert torch.equal(parts[1]["pair"][1], mask[MICROBATCH:])
    as_given = [(ids[:2], mask[:2]), (ids[2:], mask[2:])]
    assert microbatches(tuple(as_given), 2, "inputs") == as_given  # a tuple at the top is m microbatches
    side = side_microbatches({"mask": mask, "pos": list(ids.chunk(2))}, 2, CPU)
    assert torch.equal(side[1]["mask"], mask[MICROBATCH:]) and torch.equal(side[0]["pos"], ids[:MICROBATCH])
    with pytest.raises(ValueError, match="not 'chunk'"):
        side_microbatches({"chunk": mask}, 2, CPU)
    with pytest.raises(ValueError, match="side input 'mask' has 3 microbatches"):
        side_microbatches({"mask": [mask] * 3}, 2, CPU)
    with pytest.raises(ValueError, match="not divisible by m=3"):
        microbatches({"ids": ids}, 3, "inputs")


# ---- the executor on one rank: two stages of a V hand over locally ----------------------------------
class NoMailbox:
    """A one-rank Program has no transfers."""

    def send(self, *args):
        raise AssertionError("nothing crosses on one rank")

    recv = send

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        pass


def run_one_rank(name: str, form: str, m: int, stages=None):
    schedule = schedules.get(name)(p=1, m=m)
    stages = stages or toy_stages(form, schedule.num_stages)
    ids, targets, mask = toy_data(m, seed=2)
    xs, ys = list(ids.chunk(m)), list(targets.chunk(m))
    side = [{"mask": part} for part in mask.chunk(m)]
    out_specs = {}
    for mb in range(m):
        x_spec = ActivationSpec.of(xs[mb])
        for s in range(schedule.num_stages - 1):
            x_spec = out_specs[(s, mb, 0)] = infer_output_spec(stages[s], x_spec, CPU, side[mb])
    compute = ModuleCompute(dict(enumerate(stages)), loss_fn, schedule.num_stages - 1, m, SavedTensorTracker())
    executor = RankExecutor(validate(schedule), 0, compute, NoMailbox(), CPU, {}, out_specs)
    record = executor.run(xs, ys, side)
    return sum(record.losses) / m, {s: [p.grad for p in mod.parameters()] for s, mod in enumerate(stages)}


@pytest.mark.parametrize("name", ["zb-v", "interleaved-1f1b"])  # split backward on a V; fused on a loop
@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_one_rank_runs_structured_stages_exactly(name, form):
    loss, grads = run_one_rank(name, form, 3)
    ref_loss, ref_grads = reference(form, 2, 3)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    for stage, want in ref_grads.items():
        for got, w in zip(grads[stage], want, strict=True):
            assert torch.allclose(got, w, rtol=1e-12, atol=0)


def test_an_output_that_changes_shape_is_caught_before_a_local_hand_over():
    class Grows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.calls = TupleFirst(), 0

        def forward(self, ids, *, mask):
            hidden, ids = self.inner(ids, mask=mask)
            if hidden.device.type != "meta":
                self.calls += 1
            return (hidden, ids) if self.calls < 2 else (hidden, ids[:, :1])

    stages = [Grows(), toy_stages("tuple", 2)[1]]
    with pytest.raises(SpecMismatchError, match=r"stage 0, microbatch 1: output\[1\] is int64\[2, 1\], but the "
                                                r"shape pass of the first step announced int64\[2, 4\] to stage 1"):
        run_one_rank("zb-v", "tuple", 3, stages)
