"""The runtime: runs a schedule's lowered Program on `torch.distributed`, one process per rank.

Stage module contract (what `PipelineRunner` expects of the modules it is given):

* A stage is an `nn.Module` that takes **one tensor** and returns **one tensor**.
* Stage 0 takes the token ids, `LongTensor[b, s]`; every other stage takes the previous
  stage's output (a floating tensor; it is given `requires_grad=True` by the runtime).
* The last stage returns logits `[b, s, V]`; `loss_fn(output, target) -> scalar tensor`
  turns them into the microbatch loss (a mean, so that the step loss, the mean over the m
  microbatch losses, matches one process on the whole batch).
* A stage's output must depend on its input (its input gradient is sent upstream), and
  shapes and dtypes must stay those of the first step (the shape pass fixes them).
* Modules must not keep tensors from one call to the next, and the runtime may call
  their forward on the "meta" device once to infer output shapes.

Entry points:

    PipelineRunner(schedule, stages, loss_fn, *, rank=None, group=None, device=None,
                   timeout_s=300.0, optimizer=None, record_timeline=False, compute=None)
        .step(inputs, targets) -> StepResult
    launch.spawn(fn, nprocs, *, args=(), timeout_s=600.0, ...) -> list   # fn(ctx, *args)
    launch.init_from_env(*, timeout_s=300.0) -> DistContext              # under torchrun
    emulate.EmulatedCompute(costs, ...)                                 # sleep instead of compute
    memory.profile_stage_memory(stages, inputs, loss_fn, target)        # M_B, M_W per stage
"""
from .comm import PeerTimeoutError
from .executor import ActionError
from .launch import DistContext, RankFailedError, check_world, init_from_env, spawn
from .memory import SavedTensorTracker, StageMemory, profile_stage_memory
from .runner import PipelineRunner, StepResult
from .shapes import SpecMismatchError, TensorSpec

__all__ = [
    "ActionError", "DistContext", "PeerTimeoutError", "PipelineRunner", "RankFailedError", "SavedTensorTracker",
    "SpecMismatchError", "StageMemory", "StepResult", "TensorSpec", "check_world", "init_from_env",
    "profile_stage_memory", "spawn",
]
