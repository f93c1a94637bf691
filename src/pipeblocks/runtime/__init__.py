"""The runtime: runs a schedule's lowered Program on `torch.distributed`, one process per rank.

    runner = PipelineRunner(schedule, my_stages, loss_fn, rank=ctx.rank, optimizer=opt)
    result = runner.step(inputs, targets)       # StepResult: losses, measured memory, timeline

What a stage module must be (its activations, side inputs, gradients, the loss, sequence
chunks) is the stage module contract in docs/runtime.md. The entry points:

    PipelineRunner(schedule, stages, loss_fn, *, rank=None, group=None, device=None,
                   timeout_s=300.0, optimizer=None, record_timeline=False, compute=None,
                   seq_lengths=None, data_parallel=None, program=None)
        .step(inputs, targets, side_inputs=None) -> StepResult
        # program=: a Program with OPTIMIZER_STEP ops (asynchronous training); its steps go to
        # compute.optimizer_step(stage, step) and one .step runs all of them
    mesh.init_mesh(pp, dp, device) -> PipelineMesh                     # ("pp", "dp") device mesh
    data_parallel.DataParallel(stages, policies, mesh.dp_mesh)           # per-chunk sharding, DP ops
        .optimizer(torch.optim.AdamW, lr=...)                           # one optimizer per chunk
    core.cost.static_memory.predict_static_peak(program, rank, shapes, policies, ...)  # static bytes at the peak
    launch.spawn(fn, nprocs, *, args=(), timeout_s=600.0, ...) -> list   # fn(ctx, *args)
    launch.init_from_env(*, timeout_s=300.0, stop_signals=False) -> DistContext   # under torchrun
    ctx.control.step_done(k) -> bool      # after each step: True on every rank when the run is to stop
    emulate.EmulatedCompute(costs, ...)                                 # sleep instead of compute
    emulated_link.EmulatedLink(dp_model, stage_params)                 # DataParallel(link=...): modelled link times
    profile.profile_stage_memory(stages, inputs, loss_fn, target)       # M_B, M_W per stage
    profile.profile_stage_times(stages, inputs, loss_fn, target)        # F, B, W seconds per stage
"""
from .comm import PeerTimeoutError
from .executor import ActionError
from .launch import DistContext, RankFailedError, RunStoppedError, check_world, init_from_env, spawn
from .lifecycle import Interrupted
from .memory import SavedTensorTracker, StageMemory
from .profile import profile_chunk_memory, profile_stage_memory, profile_stage_times
from .runner import PipelineRunner, StepResult
from .sequence import KVCache, SequenceChunk
from .shapes import SpecMismatchError, TensorSpec

__all__ = [
    "ActionError", "DistContext", "Interrupted", "KVCache", "PeerTimeoutError", "PipelineRunner", "RankFailedError",
    "RunStoppedError", "SavedTensorTracker", "SequenceChunk", "SpecMismatchError", "StageMemory", "StepResult",
    "TensorSpec", "check_world", "init_from_env", "profile_chunk_memory", "profile_stage_memory", "profile_stage_times",
    "spawn",
]
